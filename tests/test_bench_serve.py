"""Tests for `dspark bench serve` and `dspark bench plot`: the benchmark drives a real uvicorn server
(the default model with the n-gram drafter, from server_helpers) at concurrency 1 and 2."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
from server_helpers import metric, scrape, serve, shared_engine_or_skip

from dspark.bench.client import RequestResult
from dspark.bench.load import arrival_gaps
from dspark.bench.plot import PlotUnavailable, load_report, plot_reports
from dspark.bench.serve_cli import parse_concurrencies, parse_rates
from dspark.bench.server_metrics import parse_counters, spec_delta
from dspark.bench.summary import percentile, summarize_run
from dspark.bench.table import format_table
from dspark.cli import main

REPEAT = "Count: one two three four five, one two three four five, one two three four five,"
ROWS = [{"prompt": REPEAT}, {"turns": ["List the numbers one to ten, one two three", "and again"]},
        {"prompt": "a b c d a b c d a b c d a b"}]
MAX_TOKENS = 12
LATENCIES = ("ttft", "tpot", "itl", "e2el")


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def server():
    with serve(shared_engine_or_skip("ngram")) as s:
        yield s


@pytest.fixture
def prompts(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return path


def _bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    rc = main(["bench", "serve", *argv])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def _check_run(run: dict, num: int) -> None:
    assert run["completed"] == num and run["failed"] == 0 and run["errors"] == []
    assert run["duration"] > 0
    assert math.isclose(run["request_throughput"], num / run["duration"], rel_tol=1e-2)
    assert math.isclose(run["output_throughput"], run["total_output_tokens"] / run["duration"], rel_tol=1e-2)
    assert run["total_token_throughput"] >= run["output_throughput"] > 0
    for name in LATENCIES:
        assert 0 < run[f"median_{name}_ms"] <= run[f"p99_{name}_ms"], (name, run)
        assert 0 < run[f"mean_{name}_ms"] <= run[f"p99_{name}_ms"] * (1 + 1e-9), (name, run)
    assert run["mean_ttft_ms"] < run["mean_e2el_ms"]


def test_bench_serve_concurrency_1_and_2(server, prompts, tmp_path, capsys) -> None:
    out_file = tmp_path / "fixed.json"
    before = scrape(server.url)
    rc, report, err = _bench(capsys, "--url", server.url, "--prompts", str(prompts), "--num-prompts", "4",
                             "--concurrency", "1,2", "--max-tokens", str(MAX_TOKENS), "--endpoint", "completions",
                             "--ignore-eos", "--warmup", "0", "--label", "ngram", "--output", str(out_file))
    after = scrape(server.url)
    assert rc == 0, err
    assert report == json.loads(out_file.read_text(encoding="utf-8"))
    assert report["label"] == "ngram" and report["model"] == server.state.names[0]
    assert report["speculation"]["drafter"] == "ngram"
    assert [r["concurrency"] for r in report["runs"]] == [1, 2]
    for run in report["runs"]:
        _check_run(run, 4)
        assert run["total_output_tokens"] == 4 * MAX_TOKENS  # ignore_eos: every request ran to max_tokens
        assert run["finish_reasons"] == {"length": 4}
        assert run["tau"] >= 1 and run["spec_drafts"] > 0
        assert run["tau"] == pytest.approx(1 + run["spec_accepted_tokens"] / run["spec_drafts"], abs=1e-3)
    # the figures agree with the server's own counters over the whole call (no warm-up)
    generated = metric(after, "dspark:generation_tokens_total") - metric(before, "dspark:generation_tokens_total")
    prompt = metric(after, "dspark:prompt_tokens_total") - metric(before, "dspark:prompt_tokens_total")
    assert generated == sum(r["total_output_tokens"] for r in report["runs"])
    assert prompt == sum(r["total_input_tokens"] for r in report["runs"])
    name = "dspark:spec_decode_num_drafts_total"
    assert metric(after, name) - metric(before, name) == sum(r["spec_drafts"] for r in report["runs"])
    assert report["runs"][0]["tau"] > 1  # repetitive prompts: n-gram drafts get accepted
    for title in ("Successful requests", "Mean TTFT (ms)", "P99 ITL (ms)", "Tau", "c=1", "c=2"):
        assert title in err
    engine = server.state.engine
    assert engine.pool.num_free == engine.pool.num_pages


def test_bench_serve_chat_poisson_and_plot(server, prompts, tmp_path, capsys) -> None:
    saved = tmp_path / "fixed.json"
    saved.write_text(json.dumps({"label": "other", "runs": [
        {"concurrency": 1, "output_throughput": 10.0, "mean_ttft_ms": 50.0},
        {"concurrency": 2, "output_throughput": 15.0, "mean_ttft_ms": 80.0}]}), encoding="utf-8")
    png = tmp_path / "plot.png"
    argv = ["--url", server.url, "--prompts", str(prompts), "--num-prompts", "3", "--request-rate", "50",
            "--max-tokens", "8", "--warmup", "1", "--compare", str(saved)]
    if "matplotlib" in sys.modules or _has_matplotlib():
        argv += ["--plot", str(png)]
    rc, report, err = _bench(capsys, *argv)
    assert rc == 0, err
    assert report["endpoint"] == "/v1/chat/completions" and report["label"]  # defaults to the drafter/policy
    (run,) = report["runs"]
    assert run["concurrency"] is None and run["request_rate"] == 50
    _check_run(run, 3)
    assert all(reason in ("stop", "length") for reason in run["finish_reasons"])
    assert run["tau"] >= 1
    if "--plot" in argv:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_bench_serve_counts_failures(server, prompts, capsys) -> None:
    rc, report, err = _bench(capsys, "--url", server.url, "--prompts", str(prompts), "--num-prompts", "2",
                             "--max-tokens", "4", "--warmup", "0", "--model", "no-such-model")
    assert rc == 1
    (run,) = report["runs"]
    assert run["completed"] == 0 and run["failed"] == 2 and run["output_throughput"] == 0
    assert run["errors"][0]["count"] == 2 and "404" in run["errors"][0]["error"]
    # a failing warm-up stops the benchmark early with a clear message
    assert main(["bench", "serve", "--url", server.url, "--prompts", str(prompts), "--model", "no-such-model",
                 "--warmup", "1"]) == 2
    assert "warm-up" in capsys.readouterr().err


def test_bench_serve_unreachable_server(prompts, capsys) -> None:
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--prompts", str(prompts), "--warmup", "0"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_bench_plot_overlays_reports(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    files = []
    for label, scale in (("fixed", 1.0), ("load-aware", 1.4)):
        runs = [{"concurrency": c, "output_throughput": 20 * c ** 0.5 * scale, "mean_ttft_ms": 30.0 * c}
                for c in (1, 4, 16)]
        files.append(tmp_path / f"{label}.json")
        files[-1].write_text(json.dumps({"label": label, "runs": runs}), encoding="utf-8")
    out = tmp_path / "docs" / "cmp.png"
    assert main(["bench", "plot", *map(str, files), "--output", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert "2 report(s)" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}", encoding="utf-8")
    assert main(["bench", "plot", str(bad), "--output", str(out)]) == 2


def test_plot_without_matplotlib(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(PlotUnavailable, match="pip install"):
        plot_reports([{"label": "x", "runs": [{"concurrency": 1}]}], tmp_path / "x.png")


def test_figures_and_helpers() -> None:
    assert percentile([], 99) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    ok = [RequestResult(success=True, ttft=0.1, latency=0.5, itl=[0.1, 0.3], prompt_tokens=5, output_tokens=5,
                        finish_reason="length"),
          RequestResult(success=True, ttft=0.2, latency=0.2, prompt_tokens=3, output_tokens=1, finish_reason="stop")]
    s = summarize_run([*ok, RequestResult(error="HTTP 500")], duration=2.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (2, 1, 6, 8)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 7.0
    assert s["mean_ttft_ms"] == pytest.approx(150) and s["mean_tpot_ms"] == pytest.approx(100)
    assert s["mean_itl_ms"] == pytest.approx(200) and s["errors"] == [{"error": "HTTP 500", "count": 1}]
    assert parse_concurrencies("1, 4,16,max") == [1, 4, 16, None]
    assert parse_rates("0.5,inf") == [0.5, math.inf]
    for bad in ("", "0", "x"):
        with pytest.raises(ValueError):
            parse_concurrencies(bad)
    with pytest.raises(ValueError):
        parse_rates("-1")
    gaps = arrival_gaps(2000, 10.0, seed=1)
    assert gaps[0] == 0 and sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert arrival_gaps(3, math.inf) == [0.0, 0.0, 0.0]
    text = ('# TYPE dspark:spec_decode_num_drafts counter\n'
            'dspark:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            '# TYPE dspark:spec_decode_num_accepted_tokens counter\n'
            'dspark:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0\n'
            '# TYPE dspark:spec_decode_num_verified_tokens counter\n'
            'dspark:spec_decode_num_verified_tokens_total{model_name="m"} 30.0\n')
    before = parse_counters(text.replace("10.0", "4.0").replace("15.0", "3.0").replace("30.0", "6.0"))
    delta = spec_delta(before, parse_counters(text))
    assert delta["tau"] == 3.0 and delta["acceptance_rate"] == 0.5 and delta["spec_drafts"] == 6
    assert spec_delta(None, parse_counters(text))["tau"] is None
    table = format_table([{"concurrency": 1, "completed": 3, "tau": 2.5}, {"concurrency": 4, "request_rate": 2.0}])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1  # aligned
    assert "c=4 r=2" in table and "2.500" in table


def test_load_report_defaults_label(tmp_path) -> None:
    path = tmp_path / "run-a.json"
    path.write_text(json.dumps({"runs": [{"concurrency": 1}]}), encoding="utf-8")
    assert load_report(path)["label"] == "run-a"


def test_timeout_bounds_the_whole_request() -> None:
    """--timeout limits a request's total time: a stream that keeps trickling chunks (each read
    well inside httpx's timeout) still fails once the total is exceeded."""
    import asyncio

    import httpx

    from dspark.bench.client import send_request

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        event = b'data: {"choices": [{"text": "x", "finish_reason": null}]}\n\n'
        for _ in range(12):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.2)
        writer.close()

    async def run(total: float | None) -> RequestResult:
        srv = await asyncio.start_server(trickle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        async with srv, httpx.AsyncClient(timeout=httpx.Timeout(1.0)) as client:
            return await send_request(client, f"http://127.0.0.1:{port}/v1/completions", {"prompt": "hi"},
                                      timeout=total)

    res = asyncio.run(run(1.0))
    assert not res.success and res.error.startswith("Timeout") and res.ttft is not None
    untimed = asyncio.run(run(None))  # httpx alone never fires: each chunk comes within 0.2 s
    assert not untimed.success and not untimed.error.startswith("Timeout")


def test_rate_sweep_is_drawn_in_rate_order(tmp_path, monkeypatch) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    axes = []
    real = plt.subplots

    def capture(*a, **kw):
        fig, ax = real(*a, **kw)
        axes.extend(ax)
        return fig, ax

    monkeypatch.setattr(plt, "subplots", capture)
    runs = [{"concurrency": None, "num_prompts": 32, "request_rate": r, "output_throughput": r * 10.0,
             "mean_ttft_ms": 5.0} for r in (8.0, 2.0, 4.0)]
    plot_reports([{"label": "sweep", "runs": runs}], tmp_path / "p.png")
    line = axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [2.0, 4.0, 8.0] and list(line.get_ydata()) == [20.0, 40.0, 80.0]
    assert axes[0].get_xlabel() == "request rate (req/s)"


def test_each_level_sends_its_own_prompts() -> None:
    """No level replays an earlier level's prompts (a prompt cache would answer their prefills),
    wrapping around a short file; --same-prompts sends the first ones at every level."""
    import dataclasses

    from dspark.bench.serve import ServeBenchConfig

    cfg = ServeBenchConfig("http://127.0.0.1:9", [f"p{i}" for i in range(7)], [1, 2, 4], num_prompts=3)
    assert [cfg.level_prompts(k) for k in range(3)] == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6", "p0", "p1"]]
    assert dataclasses.replace(cfg, same_prompts=True).level_prompts(2) == ["p0", "p1", "p2"]


def test_prompt_order_is_a_seeded_shuffle_of_the_whole_file_by_default(tmp_path: pathlib.Path) -> None:
    """By default the levels draw from the whole file in an order the seed fixes, so a file
    sorted by category gives every level a like mix; --prompt-order file keeps the file's order."""
    import argparse

    from dspark.bench.serve_cli import _config, add_serve_bench_parser

    path = tmp_path / "sorted.jsonl"
    rows = [{"prompt": f"{cat}{i}", "category": cat} for cat in "ab" for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    parser = add_serve_bench_parser(argparse.ArgumentParser().add_subparsers())

    def levels(*extra: str) -> list[list[str]]:
        args = parser.parse_args(["--prompts", str(path), "--num-prompts", "10", "--concurrency", "1,2", *extra])
        cfg, _ = _config(args)
        return [cfg.level_prompts(k) for k in range(2)]

    shuffled = levels()
    assert shuffled == levels("--seed", "0") != levels("--seed", "1")
    assert all({p[0] for p in level} == {"a", "b"} for level in shuffled)  # a mix at each level
    assert len({p for level in shuffled for p in level}) == 20  # no prompt twice
    assert levels("--prompt-order", "file") == [[f"a{i}" for i in range(10)], [f"a{i}" for i in range(10, 20)]]


def test_a_sweep_split_into_one_call_per_level_sends_the_same_prompts(tmp_path: pathlib.Path) -> None:
    """--first-level N: a call's first level sends what level N of one longer call sends, in
    either prompt order (servers measured in alternation run one level at a time)."""
    import argparse

    from dspark.bench.serve_cli import _config, add_serve_bench_parser

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(25)), encoding="utf-8")
    parser = add_serve_bench_parser(argparse.ArgumentParser().add_subparsers())

    def config(*extra: str):
        return _config(parser.parse_args(["--prompts", str(path), "--num-prompts", "4", *extra]))[0]

    for order in ("shuffled", "file"):
        whole = config("--concurrency", "1,2,4,8", "--prompt-order", order)
        for k in range(4):
            one = config("--concurrency", "1", "--first-level", str(k), "--prompt-order", order)
            assert one.level_prompts(0) == whole.level_prompts(k)
    with pytest.raises(ValueError, match="--first-level must be >= 0"):
        config("--first-level", "-1")
