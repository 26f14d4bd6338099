"""Which TensorFlow is installed, and the one command that gives GPUs a CUDA build.

dasktf does not depend on one TensorFlow build: ``pip install "dasktf[cpu]"`` takes
``tensorflow-cpu`` (Linux x86-64; the plain wheel elsewhere), ``"dasktf[gpu]"``
``tensorflow[and-cuda]``, and a bare ``pip install dasktf`` keeps the TensorFlow an
environment already has (a CUDA container's, say) instead of replacing it. The two
builds install the same ``tensorflow`` package, so an environment can only hold one;
a machine whose GPUs ``nvidia-smi`` lists while TensorFlow sees none almost always
holds the CPU build, and :func:`gpu_problem` says so with the command that fixes it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

#: The extras that bring a TensorFlow (pyproject.toml).
INSTALL_HINT = ('pip install "dasktf[cpu]" (or "dasktf[gpu]" on a machine with NVIDIA '
                'GPUs; from a checkout: pip install -e ".[cpu]")')


def installed_build() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed ``tensorflow`` package, e.g.
    ``("tensorflow-cpu", "2.21.0")``; ``None`` when there is none."""
    if importlib.util.find_spec("tensorflow") is None:
        return None
    names = importlib.metadata.packages_distributions().get("tensorflow", [])
    # tensorflow-cpu also ships tensorboard's entry point etc.; prefer the real owner
    for name in sorted(names, key=lambda n: not n.lower().startswith("tensorflow")):
        try:
            return name.lower().replace("_", "-"), importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "tensorflow", "unknown"


def require_tensorflow() -> None:
    """Raise an ``ImportError`` that says how to install TensorFlow, if it is not."""
    if importlib.util.find_spec("tensorflow") is None:
        raise ImportError(f"TensorFlow is not installed: {INSTALL_HINT}.")


def gpu_fix_command(build: tuple[str, str] | None) -> str:
    """The one shell command that gives this environment a TensorFlow with CUDA."""
    if build is None:
        return 'pip install "dasktf[gpu]"'
    name, version = build
    pinned = f'"tensorflow[and-cuda]=={version}"' if version != "unknown" else (
        '"tensorflow[and-cuda]"')
    if name == "tensorflow":
        # The CUDA-capable wheel without its CUDA libraries: add them.
        return f"pip install {pinned}"
    return f"pip uninstall -y {name} && pip install {pinned}"


def gpu_problem(n_gpus: int, build: tuple[str, str] | None,
                tf_gpus: int | None = None) -> str | None:
    """Why ``n_gpus`` GPUs that ``nvidia-smi`` lists will not be used, or ``None``.

    ``build`` is :func:`installed_build`'s answer where TensorFlow would run;
    ``tf_gpus`` how many GPUs TensorFlow sees there (``None``: ask TensorFlow in
    this process, unless the build is a CPU-only one, which needs no import).
    """
    if n_gpus <= 0:
        return None
    if build is None:
        return (f"nvidia-smi lists {n_gpus} GPU(s) but TensorFlow is not installed. "
                f"Fix: {gpu_fix_command(None)}")
    cuda_wheel = build[0] == "tensorflow"  # tensorflow-cpu, -intel, ...: never CUDA
    if tf_gpus is None:
        tf_gpus = 0
        if cuda_wheel:
            import tensorflow as tf

            # Enumerates the devices (cuInit); creates no CUDA context.
            tf_gpus = len(tf.config.list_physical_devices("GPU"))
    if tf_gpus > 0:
        return None
    why = ("its CUDA libraries are missing" if cuda_wheel
           else "this build has no CUDA support")
    return (f"nvidia-smi lists {n_gpus} GPU(s) but TensorFlow ({build[0]} {build[1]}) "
            f"sees none: {why}. Fix: {gpu_fix_command(build)}")
