"""jaxpar: every LLM-training parallelism of CS336 lecture 8 in JAX, proven against a reference.

Modules are imported by name (`from jaxpar import mesh, reference, comms`); importing the
package itself does not start JAX's backends, so `jaxpar.mesh.use_cpu_devices` still works
after `import jaxpar`.
"""

__version__ = "0.1.0"
