"""Background traffic and what a history arm reports, without a server: the traffic
runner is bounded and always joined (an error in the arm included), the Prometheus text
a server's /metrics answers is read as sums, and a hit names what it read."""

from __future__ import annotations

import threading

import pytest

from kvreplay.backends.http.server import metric_sums, prometheus
from kvreplay.backends.traffic import MAX_EVICTION_REQUESTS, Traffic, evict
from kvreplay.harness.rows import ServedReport
from kvreplay.harness.served import ServedArm

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:cache_config_info{block_size="32",num_gpu_blocks="256"} 1.0
not a sample
"""


def test_metrics_are_summed_by_name_and_labels_kept() -> None:
    names = {"vllm:num_requests_running": "running", "vllm:num_preemptions_total": "preemptions"}
    assert metric_sums(METRICS, names) == {"running": 3.0, "preemptions": 7.0}
    ((labels, _),) = prometheus(METRICS)["vllm:cache_config_info"]
    assert labels["num_gpu_blocks"] == "256"


def test_traffic_runs_beside_the_arm_and_is_joined_even_when_it_fails() -> None:
    sent: list[tuple[int, int]] = []
    lock = threading.Lock()

    def send(prompt: list[int], client: int) -> None:
        with lock:
            sent.append((client, len(prompt)))
        if len(sent) % 3 == 0:
            raise RuntimeError("a refused traffic request is counted, not raised")

    polled = {"running": 2.0, "waiting": 0.0, "preemptions": 5.0}
    traffic = Traffic(send, lambda: polled, 3, "seed", [[1, 2, 3]], 100)
    with pytest.raises(KeyError), traffic:
        raise KeyError("the arm failed")
    assert not any(t.is_alive() for t in traffic._threads)
    load = traffic.load
    assert load.clients == 3 and load.sent == len(sent) >= 1
    assert load.completed + load.failed == load.sent
    assert load.server_running_max == 2.0 and load.preemptions == 0.0
    assert {client for client, _ in sent} <= {0, 1, 2}


def test_eviction_is_bounded_in_requests() -> None:
    lengths: list[int] = []
    sent = evict(lambda prompt, slot: lengths.append(len(prompt)), 10**9, 100, "s", 50)
    assert len(lengths) == MAX_EVICTION_REQUESTS and sent == sum(lengths)
    lengths.clear()
    assert evict(lambda prompt, slot: lengths.append(len(prompt)), 250, 100, "s", 50) == 250


@pytest.mark.parametrize(
    ("cached", "evicted", "read", "met"),
    [(96, None, "all", True), (64, None, "part", False), (64, 4000, "part", True),
     (0, 4000, "none", True), (96, 4000, "all", True)],
)  # fmt: skip
def test_a_hit_names_what_it_read(cached: int, evicted: int | None, read: str, met: bool) -> None:
    report = ServedReport([cached], [], 96, True, evicted_tokens=evicted)
    assert report.read == read and report.condition_met is met
    assert ServedReport([0], [], 0).read is None  # a miss reads nothing by design
    beside_traffic = ServedReport([64], [], 96, True, load={"clients": 2})
    assert beside_traffic.read == "part" and beside_traffic.condition_met is True


def test_history_arms_are_named_by_their_construction() -> None:
    assert ServedArm("w", "hit", history="warm").construction == "cache-hit-warm"
    assert ServedArm("t", "hit", traffic=True).construction == "cache-hit-traffic"
    assert ServedArm("e", "hit", history="evicted").construction == "cache-hit-evicted"
