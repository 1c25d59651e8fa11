"""The offline `LLM` API as a vLLM user expects it: prompt dicts and the `sampling_params`
keyword, `chat`, an interrupted call that leaves the engine clean, settings checked at
construction, `max_tokens=None`, reproducible unseeded sampling from the engine's seed, and stop
tokens kept out of the text."""

from __future__ import annotations

import pytest
from spec_helpers import alphabet_prompts

from dspark.config import SamplingParams
from dspark.llm import LLM

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(folders):
    return LLM(model=folders["target"], drafter="none", device="cpu", dtype="float32", max_model_len=96)


def test_prompt_forms_keyword_and_chat(llm):
    ids = alphabet_prompts([12], seed=1)[0]
    ref = llm.generate([ids], GREEDY)[0].token_ids
    assert llm.generate(ids, sampling_params=GREEDY)[0].token_ids == ref
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].token_ids == ref
    assert [o.token_ids for o in llm.generate([{"prompt_token_ids": ids}, ids], GREEDY)] == [ref, ref]
    assert llm.generate({"prompt": "a b c"}, GREEDY)[0].token_ids == llm.generate("a b c", GREEDY)[0].token_ids
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm.generate({"text": "a b c"}, GREEDY)
    conv = [{"role": "user", "content": "hi"}]
    assert llm.chat(conv, GREEDY)[0].token_ids == llm.generate([conv], GREEDY)[0].token_ids
    assert len(llm.chat([conv, conv], GREEDY)) == 2
    assert not llm.engine.has_unfinished()


def test_interrupted_generate_leaves_the_engine_clean(llm, monkeypatch):
    eng = llm.engine
    real, calls = eng.step, [0]

    def interrupted():
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(eng, "step", interrupted)
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = alphabet_prompts([10, 14], seed=2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, p)
    monkeypatch.setattr(eng, "step", real)
    assert not eng.has_unfinished() and eng.pool.num_free == eng.pool.num_pages
    assert len(llm.generate(prompts[:1], p)[0].token_ids) == 40  # the next call works


def test_settings_checked_at_construction_and_max_tokens_none(llm):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    ids = alphabet_prompts([12], seed=1)[0]
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == llm.engine.max_model_len == 96


def test_engine_seed_makes_unseeded_sampling_reproducible(folders):
    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    prompt = [1, 3, 5, 7, 9]  # the small random target: its sampling is really random

    def run(seed: int) -> list[list[int]]:
        llm = LLM(model=folders["small_target"], drafter="none", device="cpu", dtype="float32", seed=seed)
        return [o.token_ids for o in llm.generate([prompt, prompt], sp)]

    a = run(7)
    assert a == run(7)
    assert a[0] != a[1]  # each request draws its own seed
    assert a != run(8)


def test_stop_token_stays_in_the_ids_not_the_text(llm):
    ids = alphabet_prompts([12], seed=1)[0]
    full = llm.generate(ids, GREEDY)[0]
    tok = full.token_ids[3]
    cut = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert cut.finish_reason == "stop" and cut.token_ids[-1] == tok
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    assert cut.text == llm.tokenizer.decode(cut.token_ids[:-1], skip_special_tokens=True)
    assert cut.text != llm.tokenizer.decode(cut.token_ids, skip_special_tokens=True)  # tok has text


def test_async_engine_leaves_the_callers_params_alone(llm):
    """Two requests sharing one SamplingParams, with different max_tokens: each gets its own limit
    (the worker used to write max_tokens into the shared object, changing the first request's)."""
    import asyncio

    from dspark.scheduler.scheduler import AsyncEngine

    shared = SamplingParams(temperature=0, ignore_eos=True)
    prompt = alphabet_prompts([12], seed=1)[0]

    async def run() -> list[int]:
        sched = AsyncEngine(llm.engine, max_queue=4)
        sched.start()
        try:
            a = await sched.add("shared-a", prompt, shared, max_tokens=3)
            b = await sched.add("shared-b", prompt, shared, max_tokens=6)
            return [len((await s.result()).token_ids) for s in (a, b)]
        finally:
            await sched.stop()

    assert asyncio.run(run()) == [3, 6] and shared.max_tokens == 16


def test_vllm_output_shape_and_n_samples(llm):
    """`outputs[0].text`, `prompt` and n samples per prompt, as a vLLM script reads them: each
    sample is the one-sample request with seed + i, token for token."""
    greedy = llm.generate("a b c", GREEDY)[0]
    assert greedy.prompt_token_ids == llm.get_tokenizer().encode("a b c")
    assert greedy.prompt == "a b c" and len(greedy.outputs) == 1
    one = greedy.outputs[0]
    assert (one.index, one.text, one.token_ids, one.finish_reason) == (0, greedy.text, greedy.token_ids, "length")
    assert one.finished() and one.cumulative_logprob is None
    ids = alphabet_prompts([12], seed=3)[0]
    assert llm.generate([ids], GREEDY)[0].prompt is None
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    assert "hi" in chat.prompt and chat.prompt != "hi"
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7, logprobs=0)
    outs = llm.generate(["a b c", ids], SamplingParams(**{**vars(sampled), "n": 3}))
    assert [len(o.outputs) for o in outs] == [3, 3] and not llm.engine.has_unfinished()
    for out, prompt in zip(outs, ["a b c", ids]):
        assert [s.index for s in out.outputs] == [0, 1, 2] and out.token_ids == out.outputs[0].token_ids
        for i, s in enumerate(out.outputs):
            alone = llm.generate([prompt], SamplingParams(**{**vars(sampled), "seed": 7 + i}))[0]
            assert s.token_ids == alone.token_ids and s.text == alone.text
            assert s.cumulative_logprob == pytest.approx(sum(t.logprob for t in alone.logprobs))
    assert len({tuple(s.token_ids) for s in outs[0].outputs}) > 1  # different seeds, different samples


def test_n_and_sampling_params_types_are_checked(llm):
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(TypeError, match="a SamplingParams or a list of them"):
        llm.generate(["a"], [{"temperature": 0}])
    assert len(llm.generate(["a", "b"], (GREEDY, GREEDY))) == 2
    changed = SamplingParams(temperature=0, max_tokens=4)
    changed.n = 0
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        llm.generate(["a"], changed)
    with pytest.raises(ValueError, match="one sample per request"):
        llm.engine.add_request("x", "a", SamplingParams(n=2))
    assert not llm.engine.has_unfinished()
    import dspark

    assert "LLM" in dir(dspark)


def test_chat_template_options(llm):
    """LLM.chat takes vLLM's template options: the prompt ends where they say, and a bad
    combination fails before anything is queued."""
    conv = [{"role": "user", "content": "hi"}]
    opened = llm.chat(conv, GREEDY)[0].prompt
    closed = llm.chat(conv, GREEDY, add_generation_prompt=False)[0].prompt
    assert opened.startswith(closed) and len(opened) > len(closed)
    partial = conv + [{"role": "assistant", "content": "Hello the"}]
    cont = llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("Hello the")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(partial, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="may not set 'tools'"):
        llm.chat(conv, GREEDY, chat_template_kwargs={"tools": []})
    assert not llm.engine.has_unfinished()
