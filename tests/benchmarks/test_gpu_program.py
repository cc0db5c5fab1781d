"""benchmarks.gpu_program on CPU: the GPU benchmark's steps lowered for CUDA (cuDNN's
attention as on an H200), counted op by op, and two censuses compared."""

import json

from benchmarks import gpu_program
from jaxpar.kernels import attention


def test_a_census_drops_names_and_locations_and_counts_lines():
    text = ('%0 = stablehlo.add %arg0, %arg1 : tensor<4xf32> loc(#loc3)\n'
            '%7 = stablehlo.add %2, %5 : tensor<4xf32>\n'
            '%8 = call @body_12(%7) : (tensor<4xf32>) -> tensor<4xf32>\n#loc3 = loc("x.py":1:2)\n')
    assert gpu_program.census(text) == {"% = stablehlo.add %, % : tensor<4xf32>": 2,
                                        "% = call @f(%) : (tensor<4xf32>) -> tensor<4xf32>": 1}
    assert gpu_program.differences({"a": 2, "b": 1}, {"a": 3, "c": 1}) == ["+1 a", "-1 b", "+1 c"]


def test_the_124m_step_lowers_with_cudnn_attention_and_the_same_census_twice(tmp_path, capsys):
    """Two runs of the same commit agree line for line, the step holds cuDNN's flash
    attention (forward and backward per layer, under the layer scan), and the platform
    the attention chooses by is restored afterwards."""
    assert gpu_program.main(["--only", "124M", "--out", str(tmp_path)]) == 0
    lines = json.loads((tmp_path / "gpu_program.json").read_text())["models"]["124M"]
    assert any("__cudnn$fmhaSoftmax" in line for line in lines), "no cuDNN attention in the step"
    assert gpu_program.main(["--only", "124M", "--against", str(tmp_path / "gpu_program.json")]) == 0
    assert "against" in capsys.readouterr().out.splitlines()[-1]
    assert attention._platform(None) != "gpu"


def test_an_unknown_model_is_named():
    assert gpu_program.main(["--only", "7B"]) == 2
