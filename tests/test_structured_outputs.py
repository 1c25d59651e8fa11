"""Structured outputs over HTTP (response_format, structured_outputs, guided_*): the output follows
the constraint, is the same with and without speculation (greedy), stays valid when sampled, and
constraints that cannot work are a 400 naming their field (the default model, n-gram drafter)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from server_helpers import error_of, serve, shared_engine_or_skip

pytestmark = pytest.mark.usefixtures("single_thread")
pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a JSON object describing a person with a name and an age."}]


@pytest.fixture(scope="module")
def server():
    with serve(shared_engine_or_skip("ngram")) as s:
        yield s


def _chat(s, body: dict) -> tuple[str, dict]:
    r = httpx.post(s.url + "/v1/chat/completions", json={"model": s.state.names[0], "messages": ASK,
                                                         "temperature": 0, "max_tokens": 48, **body}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    {"structured_outputs": {"json": PERSON}}, {"guided_json": json.dumps(PERSON)},
], ids=["response_format", "structured_outputs", "guided_json"])
def test_json_schema_output_follows_the_schema(server, body):
    text, out = _chat(server, body)
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
    assert out["choices"][0]["finish_reason"] == "stop"
    plain, _ = _chat(server, {**body, "speculation": {"enabled": False}})
    assert plain == text


def test_json_object_choice_regex_and_grammar(server):
    ann = [{"role": "user", "content": "Write Ann (31) as a JSON object with the keys name and age."}]
    text, out = _chat(server, {"response_format": {"type": "json_object"}, "max_tokens": 200, "messages": ann})
    assert out["choices"][0]["finish_reason"] == "stop" and isinstance(json.loads(text), dict), text
    choices = ["red", "green", "blue (dark)"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        text, _ = _chat(server, body)
        assert text in choices
    text, _ = _chat(server, {"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)
    grammar = 'root ::= "yes" | "no" | "maybe, " [a-z]+'
    text, out = _chat(server, {"structured_outputs": {"grammar": grammar}, "max_tokens": 8})
    if out["choices"][0]["finish_reason"] == "stop":  # the grammar let it end: the whole sentence
        assert re.fullmatch(r"yes|no|maybe, [a-z]+", text), text
    else:  # cut by max_tokens inside the unbounded [a-z]+: a prefix the grammar can still finish
        assert out["choices"][0]["finish_reason"] == "length" and re.fullmatch(r"maybe, [a-z]*", text), text


def test_sampled_outputs_stay_valid_with_speculation(server):
    r = httpx.post(server.url + "/v1/completions", json={
        "model": server.state.names[0], "prompt": "A phone number: ", "temperature": 1.0, "seed": 3, "n": 8,
        "max_tokens": 16, "guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}, timeout=120)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c["text"]), c["text"]


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),  # the second one named
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a+", "ignore_eos": True}, "guided_regex"),
    ({"guided_regex": "a+", "allowed_token_ids": [64]}, "guided_regex"),
])
def test_bad_constraints_are_refused(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": server.state.names[0], "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_shipped_drafter_greedy_equals_plain_under_a_schema(tree):
    """Draft rows are masked through their paths (chains and trees): speculative output equals
    plain constrained output, and drafts are still accepted."""
    from spec_helpers import run_requests

    from dspark.config import EngineConfig, SamplingParams, SpecConfig, StructuredOutputs
    from dspark.engine.engine import Engine
    from dspark.models.loader import ModelLoadError

    try:
        engine = Engine(EngineConfig(kv_cache_tokens=4096, spec=SpecConfig(tree=tree, tree_budget=8)))
    except ModelLoadError as e:
        pytest.skip(str(e))
    if engine.spec.name != "dspark":
        pytest.skip("the shipped drafter is not installed")
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(json=json.dumps(PERSON)))
    reqs = [(ASK, sp, None), ([{"role": "user", "content": "A JSON person, please: Ada, 36."}], sp, None)]
    spec = run_requests(engine, reqs)
    plain = run_requests(engine, reqs, spec=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(set(json.loads(o.text)) == {"name", "age"} for o in spec)
    assert engine.spec_stats.accepted > 0


def test_a_draft_path_through_eos_leaves_the_matcher_as_it_was():
    """A chain whose drafts complete the grammar and then propose EOS (an n-gram drafter repeating
    an earlier answer does): the rows after the EOS are never read, the step does not fail, and
    the matcher is back at the request's own state."""
    import torch

    from dspark.config import StructuredOutputs
    from dspark.engine.structured import GrammarCache, mask_rows
    from dspark.models.loader import ModelLoadError, load_tokenizer, resolve_model_folder

    try:
        tok = load_tokenizer(resolve_model_folder(None))
    except ModelLoadError as e:
        pytest.skip(str(e))
    cache = GrammarCache(tok, 49152)
    matcher = cache.matcher(StructuredOutputs(choice=("red", "green")))
    red = tok.encode("red", add_special_tokens=False)
    eos = tok.eos_token_id
    prefixes = [red[:i] for i in range(len(red) + 1)] + [red + [eos], red + [eos, 9]]
    rows = torch.zeros(len(prefixes), 49152)
    mask_rows(matcher, rows, prefixes)
    allowed = [set((r > float("-inf")).nonzero()[:, 0].tolist()) for r in rows]
    assert allowed[len(red)] == {eos}  # "red" is complete: only the end may follow
    assert allowed[-1] == allowed[-2] == allowed[0]  # after the EOS: unused rows, the first row's mask
    assert not matcher.is_terminated() and all(matcher.accept_token(t) for t in red + [eos])


def test_drafts_are_proposed_inside_the_grammar():
    """DraftConstraint masks each position from the state after the drafts before it, stops a row
    whose grammar has ended, and rolls every matcher back."""
    import torch

    from dspark.config import StructuredOutputs
    from dspark.engine.structured import DraftConstraint, GrammarCache
    from dspark.models.loader import ModelLoadError, load_tokenizer, resolve_model_folder

    try:
        tok = load_tokenizer(resolve_model_folder(None))
    except ModelLoadError as e:
        pytest.skip(str(e))
    cache = GrammarCache(tok, 49152)
    matchers = [cache.matcher(StructuredOutputs(choice=("red", "green"))), None]
    dc = DraftConstraint(matchers, 49152, None)
    g = torch.Generator().manual_seed(0)
    drafts = []
    for k in range(6):
        logits = dc.mask(torch.randn(2, 49152, generator=g), k)
        pick = logits.argmax(-1)
        drafts.append(int(pick[0]))
        dc.advance(pick, k)
    stop = dc.finish()
    text = tok.decode(drafts[:stop[0]])
    assert stop[1] is None and text in ("red", "green", "red" + tok.eos_token, "green" + tok.eos_token)
    assert drafts[stop[0] - 1] == tok.eos_token_id and stop[0] < 6  # ended at the EOS
    assert all(matchers[0].accept_token(t) for t in tok.encode("green", add_special_tokens=False))


def test_shipped_drafter_sampling_stays_inside_a_regex():
    from spec_helpers import run_requests

    from dspark.config import EngineConfig, SamplingParams, StructuredOutputs
    from dspark.engine.engine import Engine
    from dspark.models.loader import ModelLoadError

    try:
        engine = Engine(EngineConfig(kv_cache_tokens=4096))
    except ModelLoadError as e:
        pytest.skip(str(e))
    if engine.spec.name != "dspark":
        pytest.skip("the shipped drafter is not installed")
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    reqs = [("My phone number is ", SamplingParams(temperature=0.9, seed=i, max_tokens=20,
                                                   structured_outputs=StructuredOutputs(regex=pattern)), None)
            for i in range(6)]
    for out in run_requests(engine, reqs):
        assert re.fullmatch(pattern, out.text), out.text
    assert engine.spec_stats.accepted > 0


def test_tree_drafts_are_built_inside_the_grammar():
    """build_trees with a TreeConstraint: every node's path is a prefix the grammar accepts, a
    request without a grammar gets its unconstrained tree, and the matchers are rolled back."""
    import torch

    from dspark.config import StructuredOutputs
    from dspark.engine.structured import GrammarCache, TreeConstraint
    from dspark.engine.tree import build_trees
    from dspark.models.loader import ModelLoadError, load_tokenizer, resolve_model_folder

    try:
        tok = load_tokenizer(resolve_model_folder(None))
    except ModelLoadError as e:
        pytest.skip(str(e))
    matcher = GrammarCache(tok, 49152).matcher(StructuredOutputs(regex=r"[0-9]{2}-[a-c]{2}"))
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 6, 49152, generator=g)
    anchors = torch.tensor([tok.eos_token_id, 5])
    kw = dict(budget=[12, 12], max_depth=[6, 6], topk=3)
    free = build_trees(base, anchors, None, **kw)
    trees = build_trees(base, anchors, None, **kw, constraint=TreeConstraint([matcher, None], 49152, None))
    assert trees[1].tokens == free[1].tokens and len(trees[0]) > 0
    t = trees[0]
    for i in range(len(t)):
        path, node = [], i + 1
        while node:
            path.insert(0, t.tokens[node - 1])
            node = t.parents[node - 1]
        assert all(matcher.accept_token(x) for x in path), tok.decode(path)
        matcher.rollback(len(path))
    assert not matcher.is_terminated() and matcher.accept_token(tok.convert_tokens_to_ids("1"))
