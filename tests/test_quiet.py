"""Quiet by default: no TensorFlow start-up lines from the client or the workers.

Every process that imports TensorFlow prints INFO lines at import (``cpu_feature_guard``
on CPUs with instructions the build does not use; on CPUs with AVX-512 VNNI/BF16,
oneDNN's notice and absl's "before InitializeLog" header, which no level hides:
dasktf/cluster/quiet.py). These tests run real processes with the variable unset, as a
user's shell would have it (conftest.py sets it for the test session itself). The
end-to-end ones compare with what a bare ``import tensorflow`` prints on the machine
they run on; the mechanism is also tested with a module that writes TensorFlow's
lines itself, so it is checked on every CPU.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import textwrap

import pytest

from dasktf.cluster import quiet

#: The lines TensorFlow's C++ logging prints when a process imports it.
TF_STARTUP = re.compile(r"onednn|absl::InitializeLog|cpu_feature_guard|^I0000 ", re.I)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return {**env, **extra}


def _run(args: list[str], timeout: float = 240, **env: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=_env(**env))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    return output


def _startup_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if TF_STARTUP.search(line)]


@functools.cache
def bare_import_lines() -> tuple[str, ...]:
    """What one process prints importing TensorFlow unconfigured on this machine:
    the yardstick (a CPU whose features the build uses fully prints nothing)."""
    output = _run([sys.executable, "-c", "import tensorflow"], timeout=120)
    return tuple(_startup_lines(output))


@pytest.fixture(scope="module")
def import_lines():
    lines = bare_import_lines()
    if not lines:
        pytest.skip("TensorFlow prints no start-up lines on this machine: nothing to hide")
    return lines


def _cli_fit(*extra: str) -> str:
    return _run([sys.executable, "-m", "dasktf.cli", "fit", "--workers", "2",
                 "--epochs", "1", "--quiet", "--no-validation", *extra])


@pytest.mark.slow
def test_cli_fit_on_an_embedded_cluster_prints_no_tensorflow_startup_lines(import_lines):
    output = _cli_fit()
    assert "done:" in output, output[-3000:]
    assert _startup_lines(output) == [], output[-3000:]


def test_verbose_sets_the_level_workers_are_spawned_with(monkeypatch):
    """``--verbose`` sets level 0 before anything imports TensorFlow, and the
    embedded cluster spawns its workers with the level of this process (a level the
    user set wins). The end-to-end check of the mechanism is the test above."""
    import dask

    from dasktf.cli.common import configure_logging
    from dasktf.cluster.local import spawn_environment

    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    configure_logging(verbose=True)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
    with spawn_environment():
        spawn = dask.config.get("distributed.nanny.pre-spawn-environ")
    assert spawn["TF_CPP_MIN_LOG_LEVEL"] == "0"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    configure_logging(verbose=True)
    with spawn_environment():
        assert dask.config.get("distributed.nanny.pre-spawn-environ")[
            "TF_CPP_MIN_LOG_LEVEL"] == "3"


# -- the mechanism, on every CPU ------------------------------------------------------
#: Lines as TensorFlow 2.21 prints them before its logging is up (an AVX-512 VNNI CPU).
NOISY = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to "
    "STDERR\n"
    "I0000 00:00:1795610049.773267    2183 port.cc:153] oneDNN custom operations are on.\n"
    "I0000 00:00:1795610050.026652    2183 cpu_feature_guard.cc:227] This TensorFlow "
    "binary is optimized to use available CPU instructions.\n"
    "To enable the following instructions: AVX2 AVX512F FMA, in other operations, "
    "rebuild TensorFlow with the appropriate compiler flags.\n"
    "W0000 00:00:1795610050.026700    2183 gpu_device.cc:2342] Cannot dlopen some GPU "
    "libraries.\n"
    "E0000 00:00:1795610050.026800    2183 cuda_dnn.cc:1] Unable to register cuDNN.\n"
)


def test_the_filter_drops_what_the_level_hides_and_keeps_the_rest():
    text = NOISY + "/x/y.py:3: UserWarning: the user's own warning\n"
    assert quiet.filter_startup(text, 0) == text
    level1 = quiet.filter_startup(text, 1).splitlines()
    assert [line[:5] for line in level1] == ["W0000", "E0000", "/x/y."]
    level2 = quiet.filter_startup(text, 2).splitlines()
    assert [line[:5] for line in level2] == ["E0000", "/x/y."]
    assert quiet.filter_startup(text, 3).splitlines() == [
        "/x/y.py:3: UserWarning: the user's own warning"]


@pytest.fixture
def noisy_module(tmp_path):
    """A module whose import writes TensorFlow's lines to file descriptor 2, as
    TensorFlow's shared libraries do (not through Python's sys.stderr)."""
    (tmp_path / "noisy_tf.py").write_text(textwrap.dedent(f"""
        import os, sys
        os.write(2, {NOISY.encode()!r})
        print("python's own stderr line", file=sys.stderr)
    """))
    return tmp_path


@pytest.mark.parametrize("level, kept", [("0", 7), ("1", 3), ("2", 2)])
def test_an_installed_filter_holds_the_first_import_to_the_level(noisy_module, level,
                                                                 kept):
    code = ("from dasktf.cluster import quiet; quiet.install('noisy_tf'); import noisy_tf; "
            "import sys; assert not quiet._installed(), sys.meta_path")
    output = _run([sys.executable, "-c", code], timeout=60, TF_CPP_MIN_LOG_LEVEL=level,
                  PYTHONPATH=str(noisy_module))
    assert len(output.splitlines()) == kept, output
    assert "python's own stderr line" in output
    assert ("oneDNN" in output) == (level == "0")


@pytest.mark.slow
def test_spawned_processes_start_with_the_filter_and_keep_their_own_sitecustomize(
        tmp_path):
    """What an embedded cluster's worker (or a collective child) starts with: the
    filter is in place before a user's ``__main__`` could import TensorFlow, and a
    ``sitecustomize`` already on the path still runs."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS'] = 'ran'\n")
    env = quiet.spawn_env("1")
    env["PYTHONPATH"] += os.pathsep + str(theirs)
    code = ("import os, sys; print(any(type(f).__name__ == 'QuietTensorFlowImport' "
            "for f in sys.meta_path), os.environ.get('THEIRS'), "
            f"{quiet.STARTUP_DIR!r} in sys.path)")
    output = _run([sys.executable, "-c", code], timeout=60, **env)
    assert output.split() == ["True", "ran", "False"], output


def test_spawned_processes_skip_the_last_garbage_collection_at_exit():
    """Their exit handlers end by freezing the heap, so the interpreter's shutdown
    does not walk TensorFlow's millions of objects (a worker then exits within its
    Nanny's wait instead of being SIGKILLed); a process started without the
    variable is left as it was."""
    code = "import atexit, gc; atexit._run_exitfuncs(); print(gc.get_freeze_count() > 0)"
    spawned = _run([sys.executable, "-c", code], timeout=60, **quiet.spawn_env("1"))
    assert spawned.split() == ["True"], spawned
    env = {**quiet.spawn_env("1"), quiet.ENABLE_ENV: "0"}
    assert _run([sys.executable, "-c", code], timeout=60, **env).split() == ["False"]


def test_the_command_skips_the_last_garbage_collection_at_exit():
    """``dasktf``'s own process too: its exit handlers end by freezing the heap."""
    code = ("import atexit, gc; from dasktf.cli import main; "
            "main(['info', '--help'], standalone_mode=False); "
            "atexit._run_exitfuncs(); print(gc.get_freeze_count() > 0)")
    assert _run([sys.executable, "-c", code], timeout=120).split()[-1] == "True"


def test_the_filter_is_not_installed_at_level_zero_or_twice(monkeypatch):
    # (in-process CLI tests may have left one, for a TensorFlow not imported yet)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, quiet.QuietTensorFlowImport)])
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    assert not quiet.install("never_imported_module")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    try:
        assert quiet.install("never_imported_module")
        assert not quiet.install("never_imported_module")
    finally:
        quiet.uninstall()
    assert not quiet.install("os")  # imported already: too late, nothing to do


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_dasktf_commands_print_tensorflows_lines_only_when_verbose(verbose):
    """``configure_logging`` (every ``dasktf`` command) then TensorFlow's import: no
    start-up line; with ``--verbose``, what a bare import prints on this machine."""
    code = ("from dasktf.cli.common import configure_logging; "
            f"configure_logging(verbose={verbose}); import tensorflow")
    lines = _startup_lines(_run([sys.executable, "-c", code], timeout=120))
    assert lines if verbose and bare_import_lines() else not lines or verbose, lines
    if verbose:
        assert len(lines) == len(bare_import_lines())
