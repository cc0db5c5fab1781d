"""The memory model and the planner against the lecture (`jaxpar verify plan`): sections
4.2, 4.5, 5.1 and 7.3 and exercises 1, 3, 7, 8, each a figure the lecture prints."""

from __future__ import annotations

from jaxpar.memory import activations as A
from jaxpar.planner import catalog, exercises
from jaxpar.planner import search as S
from jaxpar.testing import Result

GPT3 = A.Block(d_model=12288, n_heads=96)


def _row(name: str, got: float, want: float, note: str, tol: float) -> Result:
    err = abs(got - want) / abs(want)
    return Result(name=name, errors={"|jaxpar - lecture| / lecture": err}, passed=err <= tol, note=note)


def check_plan() -> list[Result]:
    layer = A.layer_bytes(GPT3, seq_len=2048)
    sel = [A.layer_bytes(GPT3, seq_len=s, tp=8, sp=True, recompute="selective") for s in (2048, 131072)]
    share = 1 - sel[1] / A.layer_bytes(GPT3, seq_len=131072, tp=8, sp=True)
    h100 = catalog.accelerator("h100")
    l405 = catalog.model("llama3-405b")

    def est(tp, pp, dp, mfu=0.5, rc="full"):
        return S.evaluate(l405, S.Cluster(gpu=h100, gpus=16384, mfu=mfu), S.Candidate(tp=tp, pp=pp, dp=dp, recompute=rc),
                          tokens=16 * 2**20, seq_len=8192)
    tp8, tp16 = est(8, 16, 128, 1.0, "none").ratio("tp"), est(16, 16, 64, 1.0, "none").ratio("tp")
    pick = S.best(catalog.model("llama3-8b"), S.Cluster(gpu=h100, gpus=64), tokens=4 * 2**20, seq_len=8192).candidate
    e1, e3, e7, e8 = exercises.exercise_1(), exercises.exercise_3(), exercises.exercise_7(), exercises.exercise_8()
    return [
        _row("GPT-3 layer activations (4.2)", layer / 1e9, 2.87, f"{layer / 1e9:.2f} GB per layer, "
             f"{96 * layer / 1e9:.0f} GB for 96 (lecture 2.87, 275)", 0.005),
        _row("34sbh/t from 2K to 128K (5.1)", sel[1] / 1e9, 6.85, f"{sel[0] / 1e9:.2f} -> {sel[1] / 1e9:.2f} GB, "
             f"attention share {share:.0%} (lecture 0.11 -> 6.85 GB, 99%)", 0.005),
        _row("Llama 3 405B TP 8 comm / compute (7.3)", tp8, 0.21, f"TP 8 {tp8:.0%}, TP 16 {tp16:.1f}x (lecture 21%, "
             "about 4x) with compute at peak; at 50% MFU half", 0.05),
        _row("Llama 3 405B bubble at p x d = 2048 (7.3)", est(8, 16, 128).bubble, 15 / 31,
             f"1F1B m = p = 16: {est(8, 16, 128).bubble:.1%} (lecture: near 50%); TP8 PP16 DP128 feasible with "
             f"full recompute: {est(8, 16, 128).feasible}", 1e-9),
        Result(name="Llama 3 8B on 64 GPUs (7.3)", passed=(pick.tp, pick.pp) == (1, 1),
               errors={"tp x pp - 1": pick.tp * pick.pp - 1}, note=f"planner: {pick.label()} (lecture: t = p = 1)"),
        _row("exercise 1", e1["microbatches"], 63, f"m >= {e1['microbatches']}, {e1['tokens'] / 1e6:.2f} M tokens", 0),
        _row("exercise 3", e3["share"], 0.21, f"{e3['bytes'] / 1e9:.2f} GB, {e3['nvlink_s'] * 1e3:.1f} ms, "
             f"{e3['compute_s'] * 1e3:.0f} ms, {e3['infiniband_s'] * 1e3:.0f} ms", 0.02),
        _row("exercise 7", e7["dispatch"] / 1e6, 462, f"{e7['dispatch'] / 1e6:.0f} MB, {e7['forward'] / 1e9:.2f} GB, "
             f"{e7['forward_and_backward'] / 1e9:.2f} GB", 0.002),
        _row("exercise 8", e8["bubble"], 15 / 47, f"m = {e8['microbatches']}, bubble {e8['bubble']:.1%}", 1e-9),
    ]
