"""The tf.distribute bridge: TF_CONFIG per worker, a real MWMS step, validation."""

from __future__ import annotations

import socket
import time

import pytest

from dasktf.cluster.membership import alive_workers
from dasktf.exceptions import DasktfError
from dasktf.tf.bridge import (
    _run_child_task,
    check_tf_config,
    mwms_probe,
    run_tf_distributed,
    tf_config,
)


def test_tf_config_gives_each_worker_a_valid_config(client):
    workers = alive_workers(client)
    configs = tf_config(client)
    assert list(configs) == workers
    hosts = configs[workers[0]]["cluster"]["worker"]
    assert len(set(hosts)) == len(workers)
    assert all(h.startswith("127.0.0.1:") for h in hosts)
    assert [c["task"] for c in configs.values()] == [
        {"type": "worker", "index": i} for i in range(len(workers))
    ]
    assert check_tf_config(configs) == []


def test_tf_config_lays_out_a_parameter_server_cluster(client):
    workers = alive_workers(client)
    configs = tf_config(client, chief=True, ps=1)
    assert [configs[w]["task"] for w in workers] == [
        {"type": "chief", "index": 0}, {"type": "ps", "index": 0},
        {"type": "worker", "index": 0},
    ]
    assert check_tf_config(configs) == []
    with pytest.raises(ValueError, match="need a chief"):
        tf_config(client, ps=1)


@pytest.mark.timeout(180)
def test_a_multiworker_mirrored_step_runs_through_the_bridge(client):
    workers = alive_workers(client)[:2]
    out = run_tf_distributed(client, mwms_probe, workers=workers, timeout=120)
    # Each worker fed its index + 1; the ring summed 1 + 2 on both.
    assert [o["index"] for o in out] == [0, 1]
    assert all(o["replicas"] == 2 and o["reduced"] == 3.0 for o in out)
    assert all(o["weight"] == -3.0 for o in out)


@pytest.mark.timeout(120)
def test_a_peer_that_never_joins_is_reported_within_the_timeout(client):
    workers = alive_workers(client)[:2]
    configs = tf_config(client, workers)
    # Only worker 0's child starts: MWMS waits for worker 1, which never comes.
    future = client.submit(_run_child_task, configs[workers[0]], mwms_probe, (), 8.0,
                           workers=[workers[0]], pure=False)
    start = time.monotonic()
    with pytest.raises(DasktfError, match="did not finish within 8s") as info:
        future.result(timeout=60)
    assert workers[0] in str(info.value)
    assert time.monotonic() - start < 40


def _cfg(cluster, kind="worker", index=0):
    return {"cluster": cluster, "task": {"type": kind, "index": index}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "configs, expected",
    [
        ({"task": {"type": "worker", "index": 0}}, "needs a 'cluster'"),
        (_cfg({"worker": ["127.0.0.1:1"]}, index=1), "index 1 is out of range"),
        (_cfg({"worker": ["127.0.0.1:1"]}, kind="boss"), "not one of"),
        (_cfg({"worker": ["127.0.0.1:1"]}, kind="chief"), "has no job"),
        (_cfg({"worker": ["127.0.0.1"]}), "is not 'host:port'"),
        (_cfg({"worker": ["127.0.0.1:1", "127.0.0.1:1"]}), "share the address"),
        (_cfg({"chief": ["127.0.0.1:1", "127.0.0.1:2"]}, kind="chief"), "More than one chief"),
        (_cfg({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}), "need a 'chief'"),
        (_cfg({"worker": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2", "127.0.0.1:3"]}),
         "More than one evaluator"),
        (_cfg({"worker": ["127.0.0.1:1"], "trainer": ["127.0.0.1:2"]}), "Unknown job"),
        ([_cfg({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, index=0),
          _cfg({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, index=0)], "must be unique"),
        ([_cfg({"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}, index=0),
          _cfg({"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}, index=1)],
         "No process is task worker:2"),
        ([_cfg({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, index=0),
          _cfg({"worker": ["127.0.0.1:1", "127.0.0.1:3"]}, index=1)], "disagree"),
        (_cfg({"worker": ["no-such-host.invalid:2222"]}), "does not resolve"),
    ],
)
def test_check_tf_config_catches_each_mistake(configs, expected):
    problems = check_tf_config(configs, check_ports=expected == "does not resolve")
    assert any(expected in p for p in problems), problems


def test_check_tf_config_sees_a_port_in_use_and_passes_a_good_config():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        problems = check_tf_config(_cfg({"worker": [f"127.0.0.1:{port}"]}))
        assert any("already in use" in p for p in problems), problems
    cluster = {"chief": [f"127.0.0.1:{_free_port()}"], "worker": [f"127.0.0.1:{_free_port()}"]}
    assert check_tf_config([_cfg(cluster, "chief", 0), _cfg(cluster, "worker", 0)]) == []


def test_check_tf_config_command_exit_codes(tmp_path):
    from click.testing import CliRunner

    from dasktf.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text('{"cluster": {"worker": ["127.0.0.1:1"]}, '
                   '"task": {"type": "worker", "index": 2}}')
    result = CliRunner().invoke(main, ["check-tf-config", "--no-ports", str(bad)])
    assert result.exit_code == 1
    assert "index 2 is out of range" in result.output
    good = '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}'
    result = CliRunner().invoke(main, ["check-tf-config", "--no-ports", "-"], input=good)
    assert result.exit_code == 0 and "TF_CONFIG OK" in result.output
    result = CliRunner().invoke(main, ["check-tf-config", "-"], input="{not json")
    assert result.exit_code == 2 and "Not JSON" in result.output
    result = CliRunner().invoke(main, ["fit", "--engine", "ring"])
    assert result.exit_code == 2
