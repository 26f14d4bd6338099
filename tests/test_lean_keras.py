"""The processes dasktf spawns load Keras without its optional scikit-learn and
matplotlib integrations (dasktf/cluster/lean_keras.py): about 1 s of CPU of each
worker's Keras import. Real processes started with the environment an embedded
cluster's workers get (:func:`dasktf.cluster.quiet.spawn_env`); the mechanism with
stand-in packages (no TensorFlow), the real Keras once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dasktf.cluster import lean_keras, quiet


def _run(code: str, **env: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout.split()


@pytest.fixture
def stand_ins(tmp_path):
    """A ``keras`` that imports ``sklearn`` the way Keras does (guarded), an
    ``sklearn``, and a user's module that imports ``sklearn`` too."""
    for name, body in {
        "keras": """
            try:
                import sklearn
            except ImportError as e:
                sklearn, why = None, str(e)
        """,
        "sklearn": "",
        "users_code": "import sklearn",
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(textwrap.dedent(body))
    env = quiet.spawn_env("1")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    return env


def test_a_spawned_process_refuses_them_to_keras_alone(stand_ins):
    code = ("import sys, keras; print(keras.sklearn is None, 'sklearn' in sys.modules, "
            f"{lean_keras.ENABLE_ENV + '=0'!r} in keras.why); "
            "import users_code; print(users_code.sklearn.__name__)")
    assert _run(code, **stand_ins) == ["True", "False", "True", "sklearn"]


def test_keras_gets_them_when_imported_first_or_when_asked(stand_ins, monkeypatch):
    """Imported first (a user's code, dasktf's estimators): Keras sees them, as
    ever; ``DASKTF_LEAN_KERAS=0`` where dasktf starts its workers keeps them; a
    process dasktf did not spawn is left alone."""
    code = "import keras; print(keras.sklearn is None)"
    assert _run("import sklearn; " + code, **stand_ins) == ["False"]
    monkeypatch.setenv(lean_keras.ENABLE_ENV, "0")
    kept = quiet.spawn_env("1")
    assert kept[lean_keras.ENABLE_ENV] == "0"
    assert _run(code, **{**stand_ins, **kept, "PYTHONPATH": stand_ins["PYTHONPATH"]}) == [
        "False"]
    assert _run(code, **{lean_keras.ENABLE_ENV: "", quiet.ENABLE_ENV: "",
                         "PYTHONPATH": stand_ins["PYTHONPATH"]}) == ["False"]


@pytest.mark.slow
def test_the_real_keras_in_a_spawned_process(tmp_path):
    """Keras imports, trains nothing less (its layers, its optimizers), and its
    scikit-learn wrapper says it needs scikit-learn, which imports as usual after."""
    code = textwrap.dedent("""
        import sys, keras
        print('sklearn' in sys.modules, 'matplotlib' in sys.modules)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile('adam', 'mse')
        print(model.count_params())
        try:
            keras.wrappers.SKLearnClassifier(model=None)
        except ImportError as e:
            print('scikit-learn' in str(e))
        import sklearn.base
        print(sklearn.base.__name__)
    """)
    assert _run(code, **quiet.spawn_env("1")) == ["False", "False", "8", "True",
                                                   "sklearn.base"]

