"""Communication on real worker processes: bytes counted at the codec, codecs in
training, sharded parameter servers and reduction topologies (issue 8).

All runs share the session's 3-worker cluster and the digits data; the sync runs
are the graph engine's (its topologies, its reduction's bytes; the p2p engine's
are tests/test_p2p_engine.py's)."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import dasktf

FIT = dict(epochs=1, batch_size=60, seed=3, optimizer="adam", verbose=0, shuffle=False,
           engine="graph")


def _fit(client, data, **kw):
    x, y = data
    return dasktf.fit("mnist-mlp", x, y, client=client, **{**FIT, **kw})


def _max_diff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b, strict=False))


def test_bytes_per_step_drop_by_the_codec_factor(client, small_digits):
    base = _fit(client, small_digits).history
    n_params = 64 * 100 + 100 + 100 * 10 + 10
    bound = 2 * 2 / 3 * n_params * 4
    assert base["bytes_lower_bound"][0] == pytest.approx(bound)
    # tree of one reduction over 3 workers: 2 gradients in, 2 sums out, each
    # counted at both ends: 8 buffers over 3 workers (plus 16-byte headers)
    assert base["bytes_per_step"][0] == pytest.approx(8 / 3 * n_params * 4, rel=0.01)
    fp16 = _fit(client, small_digits, compression="fp16").history["bytes_per_step"][0]
    topk = _fit(client, small_digits, compression="topk:0.01").history["bytes_per_step"][0]
    int8 = _fit(client, small_digits, compression="int8").history["bytes_per_step"][0]
    none = base["bytes_per_step"][0]
    assert none / fp16 == pytest.approx(2.0, rel=0.01)
    assert none / int8 > 3.5
    assert none / topk >= 10


def test_topologies_give_the_same_weights(client, small_digits):
    tree = _fit(client, small_digits, epochs=2)
    ring = _fit(client, small_digits, epochs=2, topology="ring")
    naive = _fit(client, small_digits, epochs=2, topology="naive")
    assert _max_diff(ring.model.get_weights(), tree.model.get_weights()) < 1e-6
    assert _max_diff(naive.model.get_weights(), tree.model.get_weights()) == 0
    # ring: every worker sends and receives 2 (N-1)/N of a gradient: the bound
    assert ring.history["bytes_bound_ratio"][-1] == pytest.approx(1.0, rel=0.01)
    # all-to-one: the reducing worker moves N-1 gradients each way
    assert naive.history["bytes_bound_ratio"][-1] == pytest.approx(1.5, rel=0.01)


def test_two_workers_exchange_directly_for_the_same_sums(client, small_digits):
    """Two workers, codec none: no reduction task; each step sums the pair itself,
    bitwise as the all-to-one reduction does, moving the same bytes (the last
    global batch of 249 rows at 124 has one row: one worker's share is empty)."""
    from distributed import get_task_stream

    x, y = small_digits
    with get_task_stream(client) as ts:
        direct = _fit(client, small_digits, epochs=2, n_workers=2)
    naive = _fit(client, small_digits, epochs=2, n_workers=2, topology="naive")
    keys = [str(r["key"]) for r in ts.data if direct.run_id in str(r["key"])]
    assert any(k.startswith("dasktf-step") for k in keys)
    assert not any(k.startswith("dasktf-sum") for k in keys)
    assert _max_diff(direct.model.get_weights(), naive.model.get_weights()) == 0
    for key in ("bytes_per_step", "bytes_sent_per_step", "bytes_bound_ratio"):
        assert direct.history[key] == naive.history[key]
    n_params = 64 * 100 + 100 + 100 * 10 + 10
    # each worker sends one gradient and receives one per step (plus headers)
    assert direct.history["bytes_per_step"][0] == 2 * (4 * n_params + 16)
    uneven = dict(epochs=1, n_workers=2, batch_size=124, optimizer="sgd")
    short = (x[:249], y[:249])
    direct = _fit(client, short, **uneven)
    naive = _fit(client, short, topology="naive", **uneven)
    assert _max_diff(direct.model.get_weights(), naive.model.get_weights()) == 0


def test_ps_2_equals_ps_1_and_mirrored(client, small_digits):
    ps1 = _fit(client, small_digits, epochs=2, num_ps=1)
    ps2 = _fit(client, small_digits, epochs=2, num_ps=2)
    mirrored = _fit(client, small_digits, epochs=2)
    assert _max_diff(ps2.model.get_weights(), ps1.model.get_weights()) < 1e-6
    assert _max_diff(ps1.model.get_weights(), mirrored.model.get_weights()) < 1e-5
    assert ps2.history["loss"][-1] < ps2.history["loss"][0]
    # bf16 weights on the wire: close to float32, fewer bytes
    bf16 = _fit(client, small_digits, epochs=2, num_ps=2, weights_dtype="bf16")
    assert _max_diff(bf16.model.get_weights(), ps2.model.get_weights()) < 0.02
    assert bf16.history["bytes_per_step"][-1] < 0.8 * ps2.history["bytes_per_step"][-1]


def test_async_compressed_pushes_and_bf16_weights(client, small_digits):
    """The async holder decodes compressed pushes and sends bf16 weights; its
    master copy stays float32."""
    plain = _fit(client, small_digits, epochs=2, mode="async", n_workers=1)
    packed = _fit(client, small_digits, epochs=2, mode="async", n_workers=1,
                  compression="int8", weights_dtype="bf16")
    assert packed.history["loss"][-1] < packed.history["loss"][0]
    # one worker: the same updates in the same order; only the codecs differ
    assert _max_diff(packed.model.get_weights(), plain.model.get_weights()) < 0.05
    assert _max_diff(packed.model.get_weights(), plain.model.get_weights()) > 0
    # the stream's update records carry the bytes as they travelled
    from dasktf.diagnostics.events import TOPIC, unpack

    def mean_bytes(run):
        records = [r for e in client.get_events(TOPIC) for r in unpack(e)
                   if r.get("run") == run and r.get("kind") == "update"]
        assert records
        return np.mean([r["bytes"] for r in records])

    assert mean_bytes(packed.run_id) < 0.6 * mean_bytes(plain.run_id)


class _StopAt(keras.callbacks.Callback):
    def __init__(self, target):
        super().__init__()
        self.target, self.epoch = target, None

    def on_epoch_end(self, epoch, logs=None):
        if self.epoch is None and logs["val_accuracy"] >= self.target:
            self.epoch = epoch + 1
            self.model.stop_training = True


def test_topk_with_error_feedback_converges(client, digits):
    """topk:0.01 reaches the uncompressed run's accuracy target within 1.5x the
    steps (plain SGD: without momentum correction, momentum and sparsified
    updates mix poorly, see the README)."""
    target = 0.9
    kw = dict(epochs=8, batch_size=64, seed=0, verbose=0, metrics=["accuracy"],
              validation_data=(digits.x_test, digits.y_test), shuffle=True)
    stops = {}
    for compression in ["none", "topk:0.01"]:
        stop = _StopAt(target)
        budget = kw["epochs"] if compression == "none" else math.floor(1.5 * stops["none"])
        dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=client,
                   optimizer=keras.optimizers.SGD(0.5), compression=compression,
                   callbacks=[stop], **{**kw, "epochs": budget})
        assert stop.epoch is not None, f"{compression} never reached {target}"
        stops[compression] = stop.epoch
    assert stops["topk:0.01"] <= 1.5 * stops["none"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(compression="gzip"), "compression"),
        (dict(num_ps=0), "num_ps"),
        (dict(num_ps=2, placement="mirrored"), "placement='ps'"),
        (dict(weights_dtype="fp16"), "placement='ps'"),
        (dict(topology="star"), "topology"),
        (dict(mode="async", topology="ring"), "mode='sync'"),
        (dict(num_ps=2, topology="ring"), "topology"),
    ],
)
def test_bad_options_fail_before_any_work(kw, match):
    with pytest.raises(ValueError, match=match):
        dasktf.Trainer("mnist-mlp", client=None, scheduler="tcp://127.0.0.1:1", **kw)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compression", "gzip"], "Unknown compression 'gzip'"),
        (["--weights-dtype", "fp16"], "placement='ps'"),
        (["--ps", "2", "--topology", "ring"], "topology"),
    ],
)
def test_cli_bad_communication_options_exit_2(args, message):
    from click.testing import CliRunner

    from dasktf.cli import main

    result = CliRunner().invoke(main, ["fit", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.slow
def test_cli_ps_and_compression_end_to_end():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "dasktf.cli", "fit", "--workers", "3", "--epochs", "1",
         "--quiet", "--ps", "2", "--compression", "fp16", "--weights-dtype", "bf16",
         "--no-validation"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MB/step/worker" in proc.stdout and "allreduce bound" in proc.stdout


def test_ps_checkpoints_hold_exactly_the_update_they_are_named_for(client, small_digits,
                                                                    tmp_path):
    """The servers keep their slices' state at checkpoint_every's grid, as the first
    replica does: each file's Adam step count is its update's, however far ahead the
    servers had run when the client read them (8 steps: after 3, 6 and the end)."""
    import time

    from dasktf.run.checkpoint import list_checkpoints, load_latest

    class Stall(keras.callbacks.Callback):
        """Holds the client before each checkpoint, so the servers run ahead."""

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % 3 == 0:
                time.sleep(1.0)

    x, y = small_digits
    dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2, num_ps=2, epochs=1,
               batch_size=32, optimizer="adam", checkpoint_dir=str(tmp_path),
               checkpoint_every=3, verbose=0, callbacks=[Stall()])
    files = list_checkpoints(tmp_path)
    assert [p.stem for p in files] == ["ckpt-000000008", "ckpt-000000006", "ckpt-000000003"]
    for p in files:
        state, _manifest, _ = load_latest(tmp_path)
        assert int(np.asarray(state["optimizer"][0])) == state["applied"] + 1  # iterations
        p.unlink()  # the next newest is read next


# -- benchmarks/linkshape.py: the tc commands of the bandwidth-limited benchmark -------
# (pure functions only: applying them needs root and would shape the shared loopback)
def _linkshape():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "linkshape.py")
    spec = importlib.util.spec_from_file_location("linkshape", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_link_shaping_matches_only_the_workers_source_ports():
    ls = _linkshape()
    ports = ls.parse_ports("61100:61102")
    assert ports == [61100, 61101, 61102]
    cmds = ls.shaping_commands(ports, 1000, dev="lo", tc="tc")
    root, rest = cmds[0], cmds[1:]
    assert root[:8] == ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "d7f:"]
    # default 0: whatever no filter matches (everyone else's traffic) is not shaped
    assert root[8:11] == ["htb", "default", "0"]
    classes = [c for c in rest if c[1] == "class"]
    filters = [c for c in rest if c[1] == "filter"]
    assert len(classes) == len(filters) == 3
    for i, (cls, flt) in enumerate(zip(classes, filters, strict=False)):
        classid = cls[cls.index("classid") + 1]
        assert classid == f"d7f:{i + 1:x}"
        assert cls[cls.index("rate") + 1] == cls[cls.index("ceil") + 1] == "1000mbit"
        assert int(cls[cls.index("burst") + 1]) >= 2 * 65536
        # one port, exactly (mask 0xffff), as the *source*: that worker's uplink
        match = flt[flt.index("match"):flt.index("flowid")]
        assert match == ["match", "ip", "sport", str(ports[i]), "0xffff"]
        assert flt[flt.index("flowid") + 1] == classid
    assert ls.cleanup_command("lo", "tc") == ["tc", "qdisc", "del", "dev", "lo", "root"]
    # a worker's downlink instead: what is pushed to its port (dasktf.runtime.p2p)
    down = [c for c in ls.shaping_commands(ports, 1000, tc="tc", match="dport")
            if c[1] == "filter"]
    assert [f[f.index("match"):f.index("flowid")] for f in down] == [
        ["match", "ip", "dport", str(p), "0xffff"] for p in ports]
    # both: an uplink class per port (1..N) and a downlink class (N+1..2N)
    both = ls.shaping_commands(ports, 1000, tc="tc", match="both")
    both_filters = [c for c in both if c[1] == "filter"]
    assert [(f[f.index("match") + 2], f[f.index("flowid") + 1]) for f in both_filters] == [
        ("sport", "d7f:1"), ("sport", "d7f:2"), ("sport", "d7f:3"),
        ("dport", "d7f:4"), ("dport", "d7f:5"), ("dport", "d7f:6")]
    with pytest.raises(ValueError, match="sport"):
        ls.shaping_commands(ports, 1000, match="either")


def test_link_shaping_ports_stay_out_of_the_ephemeral_range():
    ls = _linkshape()
    ports = ls.parse_ports(ls.DEFAULT_PORTS)
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except OSError:
        low, high = 32768, 60999
    assert all(p > high or p < low for p in ports)
    for bad in ["0:5", "70000", "61110:61100"]:
        with pytest.raises(ValueError, match="port range"):
            ls.parse_ports(bad)
    with pytest.raises(ValueError, match="rate_mbit"):
        ls.shaping_commands(ports, 0)


def test_link_shaping_reads_tc_output():
    ls = _linkshape()
    assert ls.root_qdisc("qdisc noqueue 0: root refcnt 2 \n") == ("noqueue", "0")
    ours = "qdisc htb d7f: root refcnt 2 r2q 953 default 0 direct_packets_stat 12\n"
    assert ls.root_qdisc(ours) == ("htb", "d7f")
    stats = (
        "class htb d7f:1 root prio 0 rate 1Gbit ceil 1Gbit burst 250000b cburst 250000b \n"
        " Sent 139343580 bytes 2209 pkt (dropped 0, overlimits 0 requeues 0) \n"
        "class htb d7f:2 root prio 0 rate 1Gbit ceil 1Gbit burst 250000b cburst 250000b \n"
        " Sent 1242 bytes 10 pkt (dropped 0, overlimits 0 requeues 0) \n"
    )
    assert ls.class_bytes(stats) == {"d7f:1": 139343580, "d7f:2": 1242}


def test_packet_totals_never_write_into_a_shared_wire_array():
    from dasktf.wire.codecs import get_codec
    from dasktf.wire.packets import Packet, sum_parts

    rng = np.random.default_rng(5)
    mean = rng.standard_normal(1000).astype(np.float32)
    # topk's sum goes back dense ("none") when that is smaller, still as a mean
    dense = get_codec("topk:0.5").encode_sum(mean)
    assert dense.codec == "none"
    wire = dense.arrays[0].copy()
    shared = Packet(dense, 3, 0.0, mean=True)
    for _ in range(2):  # several replicas may read the same object
        np.testing.assert_array_equal(shared.total(), mean * np.float32(3))
    np.testing.assert_array_equal(dense.arrays[0], wire)
    plain = Packet(get_codec("none").encode(mean.copy()), 1, 0.0)
    before = plain.values.arrays[0].copy()
    total, count, _ = sum_parts([plain, plain])
    np.testing.assert_array_equal(total, 2 * before)
    np.testing.assert_array_equal(plain.values.arrays[0], before)
    assert count == 2
    # lossy packets: the decoded buffers are summed in place, same values
    fp16 = [Packet(get_codec("fp16").encode(mean), 2, 0.0, mean=True) for _ in range(3)]
    total, count, _ = sum_parts(fp16)
    expected = 3 * (mean.astype(np.float16).astype(np.float32) * np.float32(2))
    np.testing.assert_array_equal(total, expected)
    assert count == 6
