"""The demo's plain functions: its stream's prompts, its answers' records, and its summary."""

from __future__ import annotations

import json
from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from demo.stream import Answer, answer_of, make_prompts, prompt_lengths, stream_order, token_ids_of
from demo.summary import Summary, compare, count_events, counter_total, problems, prometheus_value, render, rows


def answer(index: int, prompt: int, ids: list[int] | None, status: int | None = 200, error: str = "") -> Answer:
    return Answer(index, prompt, sent_s=index * 0.5, elapsed_s=0.2, status=status, token_ids=ids, error=error)


def test_every_prompt_comes_equally_often_and_the_order_is_the_seeds() -> None:
    order = stream_order(60, 12, seed=0)
    assert len(order) == 60
    assert set(Counter(order).values()) == {5}
    assert stream_order(60, 12, seed=0) == order
    assert stream_order(60, 12, seed=1) != order
    assert sorted(Counter(stream_order(10, 4)).values()) == [2, 2, 3, 3]


def test_prompts_have_the_asked_lengths_and_distinct_first_blocks() -> None:
    lengths = prompt_lengths(12)
    assert lengths[0] == 40 and lengths[-1] == 200 and lengths == sorted(lengths)
    prompts = make_prompts(lengths, salt=0)
    assert [len(p) for p in prompts] == lengths
    assert len({tuple(p[:32]) for p in prompts}) == len(prompts)
    assert all(3 <= t < 512 for p in prompts for t in p)


def test_an_answer_is_ok_only_as_a_200_that_carries_token_ids() -> None:
    body = {"choices": [{"text": "", "token_ids": [5, 6, 7]}]}
    ok = answer_of(0, 1, 0.0, 0.1, 200, body, json.dumps(body))
    assert ok.ok and ok.token_ids == [5, 6, 7] and ok.error == ""

    body = {"error": {"message": "no prefill instance", "type": "upstream_error", "code": 503}}
    refused = answer_of(1, 1, 0.0, 0.1, 503, body, json.dumps(body))
    assert not refused.ok and refused.error == "HTTP 503: no prefill instance"
    bare = answer_of(1, 1, 0.0, 0.1, 502, None, "Bad Gateway\n")
    assert not bare.ok and bare.error == "HTTP 502: Bad Gateway"

    no_ids = answer_of(2, 1, 0.0, 0.1, 200, {"choices": [{"text": "x"}]}, '{"choices": [{"text": "x"}]}')
    assert not no_ids.ok and "without choices[0].token_ids" in no_ids.error
    assert token_ids_of({"choices": []}) is None
    assert token_ids_of({"choices": [{"token_ids": [1, "2"]}]}) is None


def test_answers_are_compared_with_the_plain_run_of_their_prompt() -> None:
    reference = {0: [1, 2, 3], 1: [4, 5, 6]}
    answers = [
        answer(0, 0, [1, 2, 3]),
        answer(1, 1, [4, 5, 6]),
        answer(2, 0, [4, 5, 6]),  # prompt 1's tokens for prompt 0
        answer(3, 1, None, status=503, error="HTTP 503: no decode instance"),
        answer(4, 1, None, status=None, error="ConnectError: refused"),
    ]
    c = compare(answers, reference)
    assert c.identical == 2
    assert [a.index for a in c.differing] == [2]
    assert [a.index for a in c.failed] == [3, 4]


def test_counters_add_up_over_the_brokers_lifetimes() -> None:
    lifetimes = [{"completed": 31, "retried": 1, "claims_moved": 2}, {"completed": 25}]
    assert counter_total(lifetimes, "completed") == 56
    assert counter_total(lifetimes, "retried") == 1
    assert counter_total(lifetimes, "stalls") == 0
    assert counter_total([], "completed") == 0


class _Fixed:
    def collect(self):  # noqa: ANN201
        yield CounterMetricFamily("kvbroker_gateway_decode_retries", "Gateway counter", value=3)
        answers = CounterMetricFamily("kvbroker_gateway_answers", "Answers by status", labels=["status"])
        answers.add_metric(["200"], 57)
        answers.add_metric(["503"], 2)
        yield answers


def test_a_metric_is_read_from_prometheus_text() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed())
    text = generate_latest(registry).decode()
    assert prometheus_value(text, "kvbroker_gateway_decode_retries") == 3
    assert prometheus_value(text, "kvbroker_gateway_answers") == 59  # summed over its labels
    assert prometheus_value(text, "kvbroker_gateway_prefill_retries") is None
    assert prometheus_value("", "kvbroker_gateway_decode_retries") is None


def test_log_events_are_counted_from_json_lines_also_behind_a_process_tag() -> None:
    lines = [
        json.dumps({"event": "transfer.loaded", "transfer_id": "a"}),
        "(EngineCore pid=12) " + json.dumps({"event": "transfer.loaded", "transfer_id": "b"}),
        json.dumps({"event": "transfer.load_failed", "transfer_id": "c", "reason": "transfer.loaded never came"}),
        "INFO 12-01 vLLM says transfer.loaded {not json",
        "",
    ]
    assert count_events(lines, "transfer.loaded") == 2
    assert count_events(lines, "transfer.load_failed") == 1
    assert count_events(lines, "transfer.sent") == 0


def summary(answers: list[Answer], reference: dict[int, list[int]]) -> Summary:
    return Summary(
        requests=len(answers), distinct=len(reference), rate=2.0, comparison=compare(answers, reference),
        completed=[3, 1], retried=1, claims_moved=1, gateway_retries=2.0, loaded=4, load_failed=0,
        in_flight_at_end=0, wall_s=171.25, phases=[("SIGKILL decode-1", 90.5)], logdir="demo-logs",
    )


def test_the_summary_names_each_field_and_fails_on_a_failed_request_or_a_differing_answer() -> None:
    reference = {0: [1, 2], 1: [3, 4]}
    good = summary([answer(0, 0, [1, 2]), answer(1, 1, [3, 4]), answer(2, 0, [1, 2]), answer(3, 1, [3, 4])], reference)
    assert problems(good) == []
    table = dict(rows(good))
    assert table["identical answers"].startswith("4 of 4 ")
    assert table["KV transfers completed"].startswith("4 (broker 1: 3, broker 2: 1")
    assert table["re-deliveries"].startswith("2 (broker: 1 after")
    assert table["failed requests"] == "0"
    assert table["wall time"] == "171.2 s"
    text = render(good)
    assert "SIGKILL decode-1" in text and "logs: demo-logs" in text and "failed or differ" not in text

    bad = summary([answer(0, 0, [1, 2]), answer(1, 1, None, 503, "HTTP 503: no prefill instance"),
                   answer(2, 0, [3, 4])], reference)
    assert problems(bad) == ["1 of 3 requests failed", "1 answers differ from the plain run"]
    text = render(bad)
    assert "HTTP 503: no prefill instance" in text and "token ids differ from the plain run" in text
