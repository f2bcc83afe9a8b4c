"""Rollout workers placed on a two-node Ray cluster, simulated on this machine.

The head node (the trainer's: the driver attaches to it) offers ``{"trainer": 1}``, the second
node ``{"rollout": 2}``; both listen on 127.0.0.1 only. Workers asking for ``{"rollout": 1}``
must all run on the second node, a killed one must come back there (its bundle of the
placement group), a training run with its workers there must equal the same run on one local
node, and resources no node offers must fail start at once with an error naming them.

What this does not show: two real machines (addresses, firewalls, clocks, a network between
the object stores). Both nodes share this machine's cores, memory and ``/dev/shm``.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from types import SimpleNamespace

import pytest
from rl_helpers import assert_same_update, train
from test_ray_rollouts import SAMPLING, by_index, gone, make_jobs, ray_rollouts

from periodic_rl.compat.ray import loopback_node
from periodic_rl.rollout.workers.placement import PlacementError

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on loopback, in a Ray temp dir of their own: the cluster's address file
    must not send another process's ``ray.init()`` (other tests on this machine) here."""
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    saved = os.environ.get("RAY_TMPDIR")
    # Short: Ray's socket paths under it must stay within the 107 characters of a Unix socket.
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="prl-", dir="/tmp")
    try:
        with loopback_node():  # 127.0.0.1 stays 127.0.0.1; raylets and workers inherit it
            nodes = Cluster(
                initialize_head=True,
                head_node_args={
                    "node_ip_address": "127.0.0.1",
                    "num_cpus": 1,
                    "resources": {"trainer": 1},
                    "include_dashboard": False,
                },
            )
            second = nodes.add_node(
                node_ip_address="127.0.0.1", num_cpus=1, resources={"rollout": 2}
            )
        yield SimpleNamespace(
            address=nodes.address, head=nodes.head_node.node_id, rollout=second.node_id
        )
        nodes.shutdown()
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved


def on_cluster(path: str, cluster, num_workers: int = 2, **kwargs):
    kwargs.setdefault("worker_resources", {"rollout": 1})
    return ray_rollouts(
        path, num_workers, ray_address=cluster.address, ray_init_kwargs={}, **kwargs
    )


def test_workers_run_and_restart_on_the_node_with_their_resource(
    cluster, tiny_llama_path, reference_engine
):
    from ray.util.placement_group import placement_group_table

    rollouts = on_cluster(tiny_llama_path, cluster).start()
    try:
        assert ray.get_runtime_context().get_node_id() == cluster.head  # the driver: node A
        info = rollouts.worker_info()
        assert [i["node_id"] for i in info] == [cluster.rollout] * 2
        assert all(i["node_ip"] == "127.0.0.1" for i in info)
        labels = rollouts.spans.lane_labels()
        assert labels["trainer"] == f"trainer @ node {cluster.head[:8]} (127.0.0.1)"
        assert labels["worker-1"] == f"worker-1 @ node {cluster.rollout[:8]} (127.0.0.1)"
        jobs = make_jobs(4)
        expected = {j.index: reference_engine.generate([j.request()], SAMPLING)[0] for j in jobs}
        assert by_index(rollouts.generate(jobs, SAMPLING, version=0)) == expected
        victim = info[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        assert gone([victim])
        assert by_index(rollouts.generate(jobs, SAMPLING, version=0)) == expected
        assert rollouts.restarts == 1
        restarted = rollouts.worker_info()[0]
        assert restarted["pid"] != victim and restarted["node_id"] == cluster.rollout
        group = rollouts._placement.group
    finally:
        rollouts.shutdown()
    with loopback_node():  # a look from outside (on loopback, as start joins): it is gone
        ray.init(address=cluster.address)
    try:
        assert placement_group_table(group)["state"] == "REMOVED"
        deadline = time.monotonic() + 10
        while ray.available_resources().get("rollout") != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.available_resources().get("rollout") == 2
    finally:
        ray.shutdown()


def test_resources_no_node_offers_fail_start_with_what_the_cluster_has(cluster, tiny_llama_path):
    rollouts = on_cluster(tiny_llama_path, cluster, 1, worker_resources={"rollout": 5})
    began = time.monotonic()
    with pytest.raises(PlacementError) as error:
        rollouts.start()
    assert time.monotonic() - began < 30
    message = str(error.value)
    assert "'rollout': 5.0" in message and "infeasible" in message  # what was asked
    assert "'rollout': 2.0" in message and "'trainer': 1.0" in message  # what the nodes have
    assert "ray start --resources" in message  # the fix
    assert not ray.is_initialized()  # start cleaned up after itself


def test_training_with_workers_on_the_second_node_equals_one_node(
    cluster, tiny_llama_path, tmp_path
):
    from periodic_rl.callbacks.timeline import PipelineTimeline

    strategy = {
        "engine": "hf",
        "num_workers": 2,
        "overlap": True,
        "groups_per_call": 1,
        "cpus_per_worker": 0.5,
    }
    two_nodes = train(
        tiny_llama_path,
        steps=2,
        strategy={**strategy, "ray_address": cluster.address, "worker_resources": {"rollout": 1}},
    )
    one_node = train(tiny_llama_path, steps=2, strategy=strategy)
    assert two_nodes[2].policy_version == one_node[2].policy_version == 2
    assert_same_update(one_node, two_nodes, "workers on the second node")
    recorder = two_nodes[2].spans
    labels = recorder.lane_labels()
    assert labels["trainer"].startswith(f"trainer @ node {cluster.head[:8]}")
    assert all(
        labels[f"worker-{i}"].startswith(f"worker-{i} @ node {cluster.rollout[:8]}")
        for i in range(2)
    )
    trace, png = PipelineTimeline().write_all(recorder, tmp_path)
    names = [
        e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
        if e["name"] == "thread_name"
    ]  # fmt: skip
    assert labels["trainer"] in names and labels["worker-0"] in names
    assert png.stat().st_size > 0


@pytest.fixture(scope="module")
def reference_engine(tiny_llama_path):
    from periodic_rl.rollout.engines.hf_engine import HFEngine

    return HFEngine(tiny_llama_path)
