"""Tensor parallelism on CPU with gloo and 2 ranks: logits equal one rank's (fp32, tolerance
1e-4 relative to the logits' scale) for Llama, Qwen2 and Qwen3 shapes, through prefill and a
decode step on the split KV cache; greedy speculative output equals plain decoding under TP=2; a
worker that dies makes the engine raise at once and the server answer 503 and exit non-zero; a
model whose heads do not split is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from spec_helpers import alphabet_prompts, assets, copy_tokenizer, make_engine, run_requests

from dspark.config import SamplingParams
from dspark.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def save_tiny_hf(folder: Path, kind: str) -> str:
    """A tiny random HF model of one family (4 heads, 2 KV heads: both split over 2 ranks)."""
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=kind == "qwen3", bos_token_id=1, eos_token_id=2)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    extra = {"head_dim": 16} if kind != "qwen2" else {}
    torch.manual_seed(7)
    model = cls[1](cls[0](**common, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)  # Qwen2's q/k/v biases: non-zero, so their slicing is checked
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return str(folder)


def _logits(engine, ids: list[int], nxt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits of every prompt row, then one decode step's, through the engine's runner."""
    seq = Sequence(seq_id=10**6, request_id="probe", prompt_ids=ids, params=SamplingParams(), generator=None,
                   eos_ids=frozenset())
    engine.pool.reserve(seq.seq_id, len(ids) + 1)
    first = engine.runner.forward([(seq, ids)], list(range(len(ids)))).logits
    seq.num_cached = len(ids)
    second = engine.runner.forward([(seq, [nxt])], [0]).logits
    engine.pool.free(seq.seq_id)
    return first, second


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_one_ranks_logits(tmp_path, kind):
    folder = save_tiny_hf(tmp_path / kind, kind)
    ids = list(range(1000, 1037))
    one = make_engine(folder)
    two = make_engine(folder, tensor_parallel_size=2)
    try:
        a, b = _logits(one, ids, 1042), _logits(two, ids, 1042)
    finally:
        two.close()
    for x, y in zip(a, b):
        scale = float(x.abs().max())
        assert float((x - y).abs().max()) <= 1e-4 * scale, (kind, float((x - y).abs().max()), scale)
    assert two.quantization  # the shard's linears were built (dense, pre-packed where it applies)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return assets(tmp_path_factory)


def test_greedy_speculation_equals_plain_decoding_on_two_ranks(folders):
    prompts = alphabet_prompts([15, 17, 33], seed=4)
    reqs = [(p, GREEDY, None) for p in prompts]
    engine = make_engine(folders["target"], folders["dspark"], tensor_parallel_size=2, tree=False)
    try:
        spec = run_requests(engine, reqs)
        plain = run_requests(engine, reqs, spec=False)
        st = engine.spec_stats
    finally:
        engine.close()
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert 0 < st.accepted < st.verified  # the drafter ran on rank 0 and was partly right


def test_a_dead_worker_stops_the_engine_instead_of_hanging(folders):
    from dspark.dist.group import PeerLost

    engine = make_engine(folders["target"], tensor_parallel_size=2)
    try:
        engine.add_request("a", alphabet_prompts([20])[0], GREEDY)
        engine.step()
        engine.workers.procs[0].kill()
        engine.workers.procs[0].join(10)
        t = time.monotonic()
        with pytest.raises(PeerLost, match="tensor-parallel"):
            for _ in range(5):
                engine.step()
        assert time.monotonic() - t < 30
    finally:
        engine.close()


def test_heads_that_do_not_split_are_a_clear_error(folders):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 does not divide the model: it has 4 "
                                         r"attention heads, 2 KV heads"):
        make_engine(folders["target"], tensor_parallel_size=3)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().split(") ")[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker through /proc")
def test_server_answers_503_and_exits_when_a_worker_dies(folders, tmp_path):
    from server_helpers import free_port, wait_for

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("DSPARK_API_KEY", None)
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--model", folders["target"],
                             "--drafter", "none", "--port", str(port), "--kv-cache-tokens", "2048",
                             "--dtype", "fp32", "--tensor-parallel-size", "2"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(ready, 120, 0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [1000, 1007, 1014], "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        spawned = [c for c in _children(proc.pid) if b"multiprocessing" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert spawned  # the worker (and multiprocessing's resource tracker): kill them all
        for pid in spawned:
            os.kill(pid, 9)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "tensor-parallel" in r.text, r.text
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


_DROP_SCRIPT = """
import os, sys
from pathlib import Path
from dspark import LLM, SamplingParams

if __name__ == "__main__":  # the workers are spawned: they re-import this file
    llm = LLM(model=sys.argv[1], drafter="none", device="cpu", dtype="float32", tensor_parallel_size=3,
              kv_cache_tokens=512)
    out = llm.generate([[1000, 1001, 1002]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].token_ids) == 4
    procs = llm.engine.workers.procs  # the Process objects only: the handle itself must go with llm
    del llm, out
    # stopped by the "stop" message (exit code 0), not killed, and reaped: no zombie left behind
    print("exitcodes", [p.exitcode for p in procs])
    me = str(os.getpid())

    def read(path, mode="r"):  # "" for a process that exited meanwhile (any process on the machine)
        try:
            return path.read_text() if mode == "r" else path.read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return "" if mode == "r" else b""

    kids = [d for d in Path("/proc").iterdir() if d.name.isdigit()
            and read(d / "stat").split(") ")[-1].split()[1:2] == [me]]
    print("workers left", [k.name for k in kids if b"spawn_main" in read(k / "cmdline", "rb")])
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="looks for leftover workers through /proc")
def test_dropping_the_llm_stops_its_workers_quietly(tmp_path):
    """A normal close (the LLM dropped after generate) says nothing: the workers used to print
    PeerLost tracebacks when rank 0's groups went away under them."""
    folder = tmp_path / "m"
    common = dict(vocab_size=49152, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=3, num_key_value_heads=3, head_dim=16, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2)  # 3 heads and 3 KV heads: one of each per rank
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).save_pretrained(folder)
    copy_tokenizer(folder)
    script = tmp_path / "drop.py"
    script.write_text(_DROP_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(script), str(folder)], env=env, cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "PeerLost" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "exitcodes [0, 0]" in r.stdout and "workers left []" in r.stdout, (r.stdout, r.stderr)
