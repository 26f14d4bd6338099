"""GPU pinning, placement and mixed precision (issue 6).

Everything here runs on a CPU machine: GPU discovery is replaced by a simulated
device list (``discover=`` or ``dasktf.gpu.simulate``), and the checks look inside
the real worker processes. Tests marked ``gpu`` need TensorFlow to see a GPU and are
skipped elsewhere.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dask
from click.testing import CliRunner
from distributed import Client, Nanny, Scheduler, SpecCluster, get_task_stream

import dasktf
from dasktf.cli import main
from dasktf.cluster.devices import GPU, parse_gpus, select_gpus, simulated_gpus
from dasktf.cluster.local import GPUCluster, choose_run_workers
from dasktf.cluster.membership import described_workers


def _tf_sees_gpu() -> bool:
    try:
        import tensorflow as tf
    except ImportError:  # a CUDA machine without TensorFlow: nothing to run on
        return False
    return bool(tf.config.list_physical_devices("GPU"))


requires_gpu = pytest.mark.skipif(
    "not _tf_sees_gpu()", reason="TensorFlow sees no GPU on this machine"
)


def two_gpus() -> list[GPU]:
    return [GPU(0, "Fake A100", 40960), GPU(1, "Fake A100", 40960)]


def no_gpus() -> list[GPU]:
    return []


# -- choosing GPUs: pure logic ------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("gpus", "n_workers", "expected"),
    [
        (None, None, [0, 1]),  # default: one worker per visible GPU
        (None, 1, [0]),
        ("all", None, [0, 1]),
        (1, None, [0]),
        ([1], None, [1]),
        ([1, 0], 2, [1, 0]),
        ("none", 3, []),
        (0, None, []),
    ],
)
def test_select_gpus(gpus, n_workers, expected):
    assert [g.index for g in select_gpus(gpus, n_workers, two_gpus)] == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("gpus", "n_workers", "discover", "match"),
    [
        (None, 3, two_gpus, "one worker per GPU and this machine has 2"),
        ([0, 1], None, no_gpus, "none were found"),
        ("all", None, no_gpus, "none were found"),
        (3, None, two_gpus, "Asked for 3 GPUs but this machine has 2"),
        ([0, 2], None, two_gpus, r"missing: \[2\]"),
        ([0, 1], 1, two_gpus, "exactly one worker per GPU"),
        ("some", None, two_gpus, "gpus must be"),
    ],
)
def test_select_gpus_errors_explain(gpus, n_workers, discover, match):
    with pytest.raises(ValueError, match=match):
        select_gpus(gpus, n_workers, discover)


@pytest.mark.timeout(30)
def test_parse_gpus_and_simulation():
    assert parse_gpus("all") == "all"
    assert parse_gpus("2") == 2
    assert parse_gpus("0,2,3") == [0, 2, 3]
    assert parse_gpus("3,") == [3]
    with pytest.raises(ValueError, match="--gpus must be"):
        parse_gpus("0;1")
    assert [g.name for g in simulated_gpus("T4,T4")] == ["T4", "T4"]
    with dask.config.set({"dasktf.gpu.simulate": 3}):
        assert len(select_gpus(None)) == 3


@pytest.mark.timeout(30)
def test_processes_false_with_gpus_is_refused():
    with pytest.raises(ValueError, match="processes=True"):
        dasktf.make_local_cluster(gpus="all", processes=False, discover=two_gpus)


@pytest.mark.timeout(60)
def test_cli_gpus_without_gpus_exits_2():
    with dask.config.set({"dasktf.gpu.simulate": None}):
        result = CliRunner().invoke(main, ["fit", "--gpus", "0,1"], env={"PATH": "/nonexistent"})
    assert result.exit_code == 2, result.output
    assert "none were found" in result.output
    assert "--gpus none" in result.output


@pytest.mark.timeout(60)
def test_cli_more_workers_than_gpus_exits_2():
    with dask.config.set({"dasktf.gpu.simulate": 2}):
        result = CliRunner().invoke(main, ["fit", "--workers", "3"])
    assert result.exit_code == 2, result.output
    assert "one worker per GPU" in result.output


# -- a CUDA machine whose TensorFlow cannot use its GPUs --------------------------
@pytest.fixture
def nvidia_smi_path(tmp_path):
    """PATH with an ``nvidia-smi`` that lists two H100s, as on a CUDA machine whose
    TensorFlow (the installed one, really imported) has no CUDA."""
    if _tf_sees_gpu():
        pytest.skip("this TensorFlow sees GPUs: nothing to refuse")
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + "".join(
        f"echo '{i}, NVIDIA H100 80GB HBM3, 81559, GPU-{i}'\n" for i in range(2)))
    exe.chmod(0o755)
    return f"{tmp_path}{os.pathsep}{os.environ['PATH']}"


def test_install_fix_commands():
    from dasktf.cluster.tfbuild import gpu_fix_command, gpu_problem

    assert gpu_fix_command(("tensorflow-cpu", "2.21.0")) == (
        'pip uninstall -y tensorflow-cpu && pip install "tensorflow[and-cuda]==2.21.0"')
    assert gpu_fix_command(("tensorflow", "2.21.0")) == (
        'pip install "tensorflow[and-cuda]==2.21.0"')
    assert gpu_fix_command(None) == 'pip install "dasktf[gpu]"'
    assert gpu_problem(2, ("tensorflow", "2.21.0"), tf_gpus=2) is None
    assert gpu_problem(0, ("tensorflow-cpu", "2.21.0")) is None
    assert "CUDA libraries are missing" in gpu_problem(1, ("tensorflow", "2.21.0"), 0)


@pytest.mark.timeout(60)
def test_cli_gpus_refused_when_tensorflow_sees_none(nvidia_smi_path):
    from dasktf.cluster.tfbuild import gpu_fix_command, installed_build

    with dask.config.set({"dasktf.gpu.simulate": None}):
        result = CliRunner().invoke(main, ["fit", "--gpus", "all"],
                                    env={"PATH": nvidia_smi_path})
    assert result.exit_code == 2, result.output
    assert "nvidia-smi lists 2 GPU(s) but TensorFlow" in result.output
    assert f"Fix: {gpu_fix_command(installed_build())}" in result.output


def test_auto_gpus_train_on_cpu_workers_and_say_why(nvidia_smi_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", nvidia_smi_path)
    with dask.config.set({"dasktf.gpu.simulate": None}):
        assert select_gpus(None) == []
    assert "sees none" in caplog.text and "Fix: pip" in caplog.text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_info_says_when_tensorflow_cannot_use_the_gpus(nvidia_smi_path):
    with dask.config.set({"dasktf.gpu.simulate": None}):
        result = CliRunner().invoke(main, ["info", "--workers", "1", "--no-tensorflow"],
                                    env={"PATH": nvidia_smi_path})
    assert result.exit_code == 0, result.output
    warning = [line for line in result.output.splitlines() if line.startswith("Warning:")]
    assert len(warning) == 1 and "Fix: pip" in warning[0], result.output


# -- pinning inside real worker processes ---------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_worker_is_pinned_to_its_gpu():
    """Worker i is spawned with CUDA_VISIBLE_DEVICES=i and advertises GPU=1."""
    with dasktf.make_local_cluster(gpus="all", discover=two_gpus) as cluster:
        assert isinstance(cluster, GPUCluster)
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            env = client.run(lambda: (os.environ["CUDA_VISIBLE_DEVICES"],
                                      os.environ["TF_FORCE_GPU_ALLOW_GROWTH"]))
            info = described_workers(client)
            by_name = {info[a]["name"]: (env[a], info[a]["resources"]) for a in info}
            assert by_name == {
                "gpu-0": (("0", "true"), {"GPU": 1}),
                "gpu-1": (("1", "true"), {"GPU": 1}),
            }
            with pytest.raises(ValueError, match="more workers than GPUs"):
                cluster.new_worker_spec()


def _mixed_cluster() -> SpecCluster:
    """An 'existing' cluster: two workers advertising GPU=1 and one CPU worker."""
    workers = {
        f"gpu-{i}": {"cls": Nanny, "options": {
            "nthreads": 1, "resources": {"GPU": 1},
            "env": {"CUDA_VISIBLE_DEVICES": str(i), "TF_NUM_INTRAOP_THREADS": "1"},
        }}
        for i in range(2)
    }
    workers["cpu"] = {"cls": Nanny, "options": {"nthreads": 1}}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0", "host": "127.0.0.1"}}
    return SpecCluster(workers=workers, scheduler=scheduler)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_steps_run_only_on_gpu_workers(digits, caplog):
    """On a cluster with GPU and CPU workers every task of a run requests GPU=1
    and runs on a GPU worker; the CPU worker is reported and left out."""
    x, y = digits.x_train[:256], digits.y_train[:256]
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with _mixed_cluster() as cluster, Client(cluster) as client:
            client.wait_for_workers(3, timeout=60)
            info = described_workers(client)
            gpu_workers = sorted(a for a, w in info.items() if w["resources"].get("GPU"))
            cpu_worker = next(a for a in info if a not in gpu_workers)
            with caplog.at_level("WARNING", logger="dasktf.cluster.local"):
                assert choose_run_workers(client, None) == (gpu_workers, {"GPU": 1})
            assert cpu_worker in caplog.text
            with get_task_stream(client) as ts:
                history = dasktf.fit(
                    "mnist-mlp", x, y, client=client, epochs=1, batch_size=64,
                    optimizer="adam", verbose=0, seed=1, mixed_precision=True,
                    engine="graph",  # its step tasks name where each step ran
                )
            assert history.workers == gpu_workers
            ran = [(t["key"], t["worker"]) for t in ts.data]
            steps = [w for k, w in ran if "dasktf-step" in str(k)]
            assert len(steps) == 2 * 4
            assert set(steps) == set(gpu_workers)
            assert all(w != cpu_worker for k, w in ran if "dasktf-" in str(k)
                       and "sum" not in str(k))
            # Mixed precision on CPU workers: bfloat16 compute, float32 weights.
            assert all("mixed_bfloat16" in r["placement"] for r in history.replica_info)
            assert np.isfinite(history.history["loss"]).all()
            assert all(w.dtype == np.float32 for w in history.model.get_weights())


# -- mixed precision in one process ------------------------------------------------
@pytest.mark.timeout(120)
def test_float16_replica_scales_loss_and_keeps_float32_gradients(digits, monkeypatch):
    """mixed_float16 (what a GPU worker gets): a LossScaleOptimizer, a float32 flat
    gradient buffer, and an apply that unscales it (weights move by a sane step)."""
    import contextlib

    import keras

    from dasktf.cluster import devices
    from dasktf.data.shards import Shard
    from dasktf.models import CompileRecipe, model_spec
    from dasktf.runtime import replica
    from dasktf.transport import ModelPackage
    from dasktf.wire.messages import GradientSum

    @contextlib.contextmanager
    def float16_policy(mixed):
        before = keras.config.dtype_policy()
        keras.config.set_dtype_policy("mixed_float16" if mixed else before)
        try:
            yield "mixed_float16"
        finally:
            keras.config.set_dtype_policy(before)

    monkeypatch.setattr(replica, "precision_policy", float16_policy)
    x, y = digits.x_train[:64], digits.y_train[:64]
    spec = model_spec("mnist-mlp", x.shape[1:], 10)
    model = spec.build()
    weights = model.get_weights()
    recipe = CompileRecipe(keras.optimizers.serialize(keras.optimizers.SGD(0.1)),
                           "sparse_categorical_crossentropy")
    cfg = replica.ReplicaConfig(ModelPackage.pack(model).ref(), recipe, 0, mixed_precision=True)
    r = replica.Replica(cfg, 0, Shard(x, y), np.array([64]))
    assert keras.config.dtype_policy().name == "float32"  # restored after the build
    assert isinstance(r.model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert r.model.dtype_policy.name == "mixed_float16"
    out = r.gradient(0, 0)
    assert out.total is not None and out.total.dtype == np.float32
    scale = float(r.model.optimizer.dynamic_scale.numpy())
    assert scale > 1  # the buffer holds scaled gradients ...
    r.apply(GradientSum(out.total, out.count, out.loss_sum))
    step = max(float(np.abs(a - b).max()) for a, b in zip(r.model.get_weights(), weights, strict=False))
    assert 0 < step < 1  # ... which apply_gradients unscaled before the update
    assert "mixed_float16" in devices.placement_summary(r.model, r.device)


# -- dasktf info ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_info_lists_both_cpu_workers_with_devices():
    with dask.config.set({"dasktf.gpu.simulate": None}):
        result = CliRunner().invoke(main, ["info", "--workers", "2"],
                                    env={"PATH": "/nonexistent"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("2 worker(s), local cluster at tcp://127.0.0.1:")
    assert "CUDA_VISIBLE_DEVICES" in lines[1] and "TensorFlow devices" in lines[1]
    rows = [line for line in lines[2:] if line.startswith("tcp://")]
    assert len(rows) == 2
    for row in rows:
        assert "CPU:0" in row and "''" in row  # TF's device list; no GPU visible


@pytest.mark.slow
@pytest.mark.gpu
@requires_gpu
@pytest.mark.timeout(240)
def test_real_gpu_workers_see_one_gpu_each():
    with dasktf.make_local_cluster(gpus="all") as cluster, Client(cluster) as client:
        from dasktf.cluster.devices import cluster_info

        rows = cluster_info(client)
        assert rows and all(r.gpu_resource == 1 for r in rows)
        for r in rows:
            assert [d for d in r.tf_devices or [] if "GPU" in d] == ["/physical_device:GPU:0"]
        assert len({r.cuda_visible_devices for r in rows}) == len(rows)


@pytest.fixture(scope="module")
def digits():
    return dasktf.load_dataset("digits")
