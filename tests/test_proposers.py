"""Every proposer kind behind the one interface: the Proposal contract and the controller without a
model, then EAGLE-3 heads and draft models through the engine (greedy speculative output equals
plain decoding), their checkpoints in the published layouts, and the errors a mismatch gives."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from spec_helpers import ALPHABET, alphabet_prompts, assets, follow, make_engine, run_requests

from dspark.config import SamplingParams, SpecConfig
from dspark.engine.controller import VerifyLengthController
from dspark.engine.policy import Policy, ThresholdPolicy
from dspark.engine.proposal import Draft
from dspark.engine.sequence import SpecStats
from dspark.engine.tree import DraftTree

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


def save_agreeing_eagle3(folder, target_folder: str, draft_vocab: list[int]) -> str:  # noqa: ANN001
    """An EAGLE-3 head built to agree with the predictable target at its first draft position.
    fc passes the captured layer-0 output (mostly the embedding of token i) through; the layer
    is zeroed, so the output is that hidden state; the LM head's row of f(f(t)) points along t's
    embedding: from position i it drafts f(f(x_i)), token i + 2 where the target follows f twice.
    A head fed the wrong position's features or the wrong next token drafts about 1% right
    (f(x_i) instead: measured), this one about a third at its first position."""
    from safetensors.torch import load_file

    from dspark.models.drafters.eagle3 import Eagle3Config, Eagle3Head, eagle3_hf_config, save_eagle3
    from dspark.models.llama import LlamaConfig
    from dspark.models.loader import load_config

    tc = LlamaConfig.from_hf(load_config(target_folder))
    emb = load_file(f"{target_folder}/model.safetensors")["model.embed_tokens.weight"]
    head = Eagle3Head(Eagle3Config.from_hf(eagle3_hf_config(tc, len(draft_vocab), 96), tc))
    H = tc.hidden_size
    layer0 = list(head.config.capture_layers).index(0)  # where hidden_states[1] sits in fc's input
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("proj.weight") or name.startswith(("fc", "lm_head")):
                p.zero_()
        head.fc.weight[:, layer0 * H:(layer0 + 1) * H] = torch.eye(H)
        for t in ALPHABET:
            head.lm_head.weight[draft_vocab.index(follow(follow(t)))] = emb[t] / emb[t].norm() * 8
        head.d2t.copy_(torch.tensor(draft_vocab) - torch.arange(len(draft_vocab)))
    save_eagle3(head, folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = assets(tmp_path_factory)
    root = tmp_path_factory.mktemp("agreeing_eagle3")
    return {**out, "eagle3_agree": save_agreeing_eagle3(root / "head", out["target"], list(range(17)) + ALPHABET)}


# ---------------------------------------------------------------- the contract, no model
def test_draft_cut_keeps_a_prefix_its_q_rows_and_the_grammar_stop():
    q = torch.softmax(torch.randn(4, 10), -1)
    d = Draft([5, 6, 7, 8], torch.tensor([0.9, 0.8, 0.7, 0.6]), q, stop=3, num_proposed=8)
    p = d.cut(4)
    assert p.tokens == [5, 6, 7] and torch.equal(p.q, q[:3]) and p.num_proposed == 8 and p.tree is None
    p = d.cut(2)
    assert p.tokens == [5, 6] and torch.equal(p.q, q[:2])
    assert d.cut(0).tokens == [] and d.cut(0).q is None
    assert Draft([1, 2]).num_proposed == 2 and Draft([1, 2]).cut(2).q is None  # one-hot: no q


def test_draft_cut_prunes_a_tree_to_its_best_nodes():
    t = DraftTree(tokens=[1, 2, 3], parents=[0, 0, 1], depths=[1, 1, 2], scores=[0.9, 0.2, 0.5])
    d = Draft([], tree=t, num_proposed=16)
    assert d.cut(3).tree is t and d.cut(3).num_proposed == 16
    top = d.cut(2).tree
    assert top.tokens == [1, 3] and top.parents == [0, 1]
    assert d.cut(0).tree is None and d.cut(0).tokens == []


def test_controller_cuts_chains_by_policy_and_budget():
    stats = SpecStats()
    drafts = [Draft([1, 2, 3, 4], torch.tensor([0.9, 0.9, 0.2, 0.9])), Draft([5, 6], None, looked_up=True)]
    fixed = VerifyLengthController(Policy(), stats)
    out = fixed.choose(drafts, [3, 8], 0, 0.0)
    assert [p.tokens for p in out] == [[1, 2, 3], [5, 6]] and out[1].looked_up
    thresh = VerifyLengthController(ThresholdPolicy(0.5), stats)
    # the first draft stops before its 0.2; the second has no confidences: the running acceptance
    # per position (0.5 before any step) stands in, which the threshold admits
    assert [p.tokens for p in thresh.choose(drafts, [4, 2], 0, 0.0)] == [[1, 2], [5, 6]]


def test_acceptance_prior_is_conditional_so_its_product_is_the_running_survival():
    stats = SpecStats()
    for accepted in [0] * 400 + [1] * 200 + [2] * 100 + [3] * 100:  # survival 1/2, 1/4, 1/8
        stats.record(proposed=3, verified=3, accepted=accepted, committed=accepted + 1)
    c = VerifyLengthController(Policy(), stats)
    prior = c.acceptance_prior(5)
    assert prior[:3].tolist() == pytest.approx([0.5, 0.5, 0.5], abs=0.01)
    assert prior.cumprod(0)[:3].tolist() == pytest.approx([0.5, 0.25, 0.125], abs=0.01)
    assert prior[3:].tolist() == [0.5, 0.5]  # no verification reached these yet


def test_controller_backs_off_while_drafting_loses_and_recovers():
    class Losing(Policy):
        last_gain = 0.5

    c = VerifyLengthController(Losing(), SpecStats())
    c.record_pass(1, 0.5)  # the very first pass (start-up costs) is neither timed nor judged
    assert not c.draft_seconds and not c.paused()
    c.record_pass(1, 0.01)  # the first timed pass is not judged: the drafter was taken to be free
    assert c.draft_seconds == {1: 0.01} and not c.paused()
    c.record_pass(1, 0.01)  # the running gain falls below 1: drafting pauses
    assert c.skip_steps == c.MIN_BACKOFF and c.backoff == 2 * c.MIN_BACKOFF
    c.policy.last_gain = 3.0  # expected to pay again: the pause runs out and the proposer is tried
    assert all(c.paused() for _ in range(c.MIN_BACKOFF)) and not c.paused()
    for _ in range(4):
        c.record_pass(1, 0.01)
    assert c.gain > 1 and c.backoff == c.MIN_BACKOFF
    assert c.estimated_draft_seconds(2) == pytest.approx(2 * c.draft_seconds[1])


class _Hopeful(Policy):
    """The policy's belief: drafting always pays."""
    last_gain = 1.5


def _measured(tokens: list[int], seconds: float) -> VerifyLengthController:
    """A controller past its start-up pass that measured 40 drafting steps, each committing the
    next of `tokens` in `seconds`, and 40 plain ones of 0.07-0.09 s."""
    c = VerifyLengthController(_Hopeful(), SpecStats())
    c.record_pass(1, 0.6)  # start-up: its step is no rate
    c.record_pass(1, 0.01)
    for i in range(40):
        c.observe_outcome(1, True, tokens[i % len(tokens)], seconds)
        c.observe_outcome(1, False, 1, 0.07 + 0.02 * (i % 2))
    return c


def test_controller_pauses_where_measured_steps_lose_whatever_the_policy_believes():
    c = VerifyLengthController(_Hopeful(), SpecStats())
    for _ in range(3):
        c.record_pass(4, 0.01, decodes=4)
    assert c.skip_steps == 0 and c.gain > 1
    for _ in range(c.MEASURED_MIN):  # drafting steps at 4 requests: 5 tokens in 0.125 s
        assert not c.paused(4, 8, decodes=4)
        c.observe_outcome(4, True, 5, 0.125)
    assert c.measured_gain(4) is None
    for _ in range(c.MEASURED_MIN):  # then plain steps are taken to measure them: 4 tokens in 0.08 s
        assert c.paused(4, 8, decodes=4) and c.skip_steps == 0
        c.observe_outcome(4, False, 4, 0.08)
    assert c.measured_gain(4) == pytest.approx(40 / 50)
    assert not c.paused(4, 8, decodes=4)  # measured enough: drafting is tried again ...
    for _ in range(3):
        c.record_pass(4, 0.01, decodes=4)  # ... and the measured loss pauses it
    assert c.skip_steps > 0 and c.gain < 1 and c.lost_at == 4
    assert c.measured_gain(2) is None  # another load keeps its own measurements
    # an unmeasured load above a measured loss takes that loss; one below it keeps its belief
    assert c._judged(1.5, 6) == pytest.approx(0.8) and c._judged(1.5, 2) == 1.5
    for _ in range(c.MEASURED_MIN):  # at 2 requests drafting pays
        c.observe_outcome(2, True, 4, 0.1)
        c.observe_outcome(2, False, 2, 0.07)
    assert c.measured_gain(2) == pytest.approx(40 / (2 / 0.07))
    assert not c.paused(2, 8, decodes=2) and c.skip_steps == 0  # the pause ends where drafting pays
    assert c._judged(1.5, 3) == 1.5  # the gain measured at 2 is not lent upward; a loss is
    assert c._judged(1.5, 6) == pytest.approx(0.8)
    for _ in range(c.PLAIN_EVERY - 1):  # and a plain step is taken every PLAIN_EVERY drafting steps
        c.observe_outcome(2, True, 4, 0.1)
    assert not c.paused(2, 8, decodes=2)
    c.observe_outcome(2, True, 4, 0.1)
    assert c.paused(2, 8, decodes=2)


def test_the_first_drafter_pass_step_is_no_measured_rate():
    """The step of the very first drafter pass carries its start-up costs (kernel set-up,
    first-touch pages; record_pass leaves that pass out of the pass time): it is not measured
    either, or one such step among the first few would price drafting out for good."""
    c = VerifyLengthController(Policy(), SpecStats())
    c.record_pass(1, 0.6)
    c.observe_outcome(1, True, 1, 0.7)  # 1 token in 0.7 s
    assert (1, True) not in c.rates
    c.record_pass(1, 0.01)
    c.observe_outcome(1, True, 2, 0.1)
    assert c.rates[1, True][:2] == [pytest.approx(20.0), 1]


def test_a_measured_loss_within_its_noise_does_not_override_the_belief():
    """Drafting steps that commit 1 or 2 tokens (as they do) measured at a little under plain
    decoding's rate: within one standard error of even, so drafting is not paused by it; the
    same spread around a clear loss pauses it."""
    noisy = _measured([1, 2, 1, 1, 1], 0.1)  # 12 tokens a second against plain's 12.7
    assert noisy.measured_gain(1) < 1.0 < noisy.measured_gain_bound(1)
    assert noisy._judged(1.5, 1) >= 1.0  # no pause
    clear = _measured([1], 0.1)  # 10 tokens a second: a loss beyond the spread of the plain steps
    assert clear.measured_gain_bound(1) < 1.0 and clear._judged(1.5, 1) < 1.0


class _Doubtful(Policy):
    """The policy's belief for each pass: its drafts were cut, so the pass looks like a loss."""
    last_gain = 0.8


class _ByConfidence(Policy):
    """The policy's belief follows the drafts' survival: drafting pays where it is 0.6 or more."""
    last_gain = None

    def choose(self, budgets, conf, other_tokens=0, draft_seconds=0.0, max_total=None):
        self.last_gain = 1.5 if conf is not None and float(conf.mean()) >= 0.6 else 0.7
        return list(budgets)


def test_a_pause_ends_for_a_few_trial_passes_once_its_text_has_left():
    c = VerifyLengthController(_ByConfidence(), SpecStats())
    c.record_pass(1, 0.6)
    c.record_pass(1, 0.01)
    c.policy.last_gain = 0.7
    c.record_pass(1, 0.01)  # a loss: drafting pauses
    c.skip_steps = c.backoff = c.MAX_BACKOFF
    assert c.paused(1, 4, 1)  # the same text: the running acceptance (no data: 0.5) says a loss
    assert c.hopeful_gain(1, 4) == 1.5
    assert not c.paused(1, 4, 1, new_text=True) and c.skip_steps == 0  # text it might draft well
    c.policy.last_gain = 0.7  # the trial passes' own beliefs: a loss, yet they all run
    for _ in range(c.NEW_TEXT_PASSES):
        c.record_pass(1, 0.01)
        assert c.skip_steps == 0
    c.record_pass(1, 0.01)
    assert c.skip_steps > 0  # then the running gain pauses drafting again

    # under load one pass holds as many requests' confidences as the four at one request: new
    # text there gets that one pass, and its loss pauses drafting at once
    assert [c.trial_passes_at(R) for R in (1, 2, 4, 8)] == [4, 2, 1, 0]
    c.skip_steps = c.backoff = c.MAX_BACKOFF
    assert not c.paused(8, 4, 8, new_text=True) and c.trial_passes == 0
    c.policy.last_gain = 0.7  # the pass's own belief
    c.record_pass(8, 0.01, decodes=8)
    assert c.skip_steps > 0

    hopeless = VerifyLengthController(_ByConfidence(), SpecStats())
    hopeless.HOPEFUL_ACCEPTANCE = 0.5  # even text drafted well would not pay at this load
    hopeless.skip_steps = hopeless.backoff = hopeless.MAX_BACKOFF
    assert hopeless.paused(1, 4, 1, new_text=True) and hopeless.skip_steps == hopeless.MAX_BACKOFF - 1


def test_new_text_that_lost_under_load_skips_the_next_trials():
    """A trial on new text over several requests that ends in a pause skips the next new-text
    events at that load and above (1, then 2, ... in a row), counted as paused steps; a trial
    that drafts on clears the losses at its load and below. At one request a trial always runs."""
    c = VerifyLengthController(_ByConfidence(), SpecStats())
    c.record_pass(8, 0.6)
    c.record_pass(8, 0.01)

    def lose_a_trial(R: int) -> None:
        c.skip_steps = c.backoff = c.MAX_BACKOFF
        assert not c.paused(R, 4, R, new_text=True) and c.text_probe == R
        c.policy.last_gain = 0.7  # the trial pass's own belief: a loss
        c.record_pass(R, 0.01, decodes=R)
        assert c.skip_steps > 0 and c.text_probe is None

    lose_a_trial(6)
    assert c.text_losses == {6: [1, 1]}
    left = c.skip_steps
    assert c.paused(8, 4, 8, new_text=True) and c.declined_text  # more requests: skipped too
    assert c.skip_steps == left - 1  # a paused step like any other
    assert not c.paused(4, 4, 4, new_text=True)  # fewer requests: no loss known there
    c.policy.last_gain = 0.7
    c.record_pass(4, 0.01, decodes=4)
    c.trial_passes = 0
    c.record_pass(4, 0.01, decodes=4)
    assert c.text_losses == {4: [1, 1], 6: [0, 1]}  # the one event at 6 was passed over

    lose_a_trial(6)  # a second loss in a row there: two events skipped
    assert c.text_losses[6] == [2, 2]
    assert c.paused(6, 4, 6, new_text=True) and c.paused(6, 4, 6, new_text=True)
    assert not c.paused(6, 4, 6, new_text=True)  # the third runs
    c.policy.last_gain = 1.5  # and drafts on
    c.record_pass(6, 0.01, decodes=6)
    assert c.skip_steps == 0 and c.text_losses == {}  # the losses at 6 and below are cleared

    one = VerifyLengthController(_ByConfidence(), SpecStats())
    one.text_losses[1] = [4, 4]  # (never recorded at one request; ignored there all the same)
    one.skip_steps = one.backoff = one.MAX_BACKOFF
    assert not one.paused(1, 4, 1, new_text=True)


def test_no_pause_ends_while_prompts_wait():
    """A step beside prompts waiting to be prefilled keeps a pause, without counting it down or
    starting a trial on new text: drafting would reserve each decode's chain and slice the
    prompts thinner. The next step without them ends the pause as it would have."""
    c = VerifyLengthController(_ByConfidence(), SpecStats())
    c.skip_steps = c.backoff = c.MAX_BACKOFF
    for _ in range(3):
        assert c.paused(1, 4, 1, new_text=True, prompts_waiting=True)
    assert c.skip_steps == c.MAX_BACKOFF and c.trial_passes == 0
    assert not c.paused(1, 4, 1, new_text=True) and c.trial_passes == c.NEW_TEXT_PASSES
    c.skip_steps, c.lost_at = 1, 8  # fewer requests than when drafting lost: resumed, unless prompts wait
    c.expected[(2, 4, None)] = 1.5
    assert c.paused(2, 4, 2, prompts_waiting=True) and c.skip_steps == 1
    assert not c.paused(2, 4, 2)


def test_a_pause_that_cannot_repay_its_catch_up_stays_on():
    """Ending a pause first writes the paused steps' drafter context; where drafting at the
    expected gain would not repay that over the tokens left (resume_pays), neither new text nor
    a falling load ends the pause, and a pause that runs out holds MIN_BACKOFF steps more
    without doubling its back-off. Where it does repay, each ends the pause as before."""
    asked = []

    def pays(answer):
        def resume_pays(gain):
            asked.append(gain)
            return answer
        return resume_pays

    c = VerifyLengthController(_ByConfidence(), SpecStats())
    c.skip_steps = c.backoff = c.MAX_BACKOFF
    c.expected[(1, 4, 0.7)] = 1.5  # hopeful: new text would be tried
    assert c.paused(1, 4, 1, new_text=True, resume_pays=pays(False)) and c.declined_text
    assert asked == [1.5] and c.trial_passes == 0 and c.skip_steps == c.MAX_BACKOFF - 1
    assert not c.paused(1, 4, 1, new_text=True, resume_pays=pays(True)) and c.trial_passes > 0
    c.skip_steps, c.lost_at, c.trial_passes = 8, 8, 0  # fewer requests than when drafting lost
    c.expected[(2, 4, None)] = 1.25
    assert c.paused(2, 4, 2, resume_pays=pays(False)) and asked[-1] == 1.25 and c.skip_steps == 7
    assert not c.paused(2, 4, 2, resume_pays=pays(True)) and c.skip_steps == 0
    c.skip_steps, c.lost_at, c.backoff = 1, 0, 32  # the pause runs out where drafting would pay
    assert c.paused(2, 4, 2, resume_pays=pays(False))
    assert c.skip_steps == c.MIN_BACKOFF and c.backoff == 32 and not c.resumed
    for _ in range(c.MIN_BACKOFF):
        assert c.paused(2, 4, 2, resume_pays=pays(True))
    assert c.resumed and not c.paused(2, 4, 2, resume_pays=pays(True))
    c.skip_steps, c.resumed = 1, False  # a catch-up that never pays holds MAX_BACKOFF steps, then a probe
    steps = 0
    while c.paused(2, 4, 2, resume_pays=pays(False)) and not c.resumed:
        steps += 1
    assert c.resumed and steps == c.MAX_BACKOFF and c.held == 0


def test_a_measured_win_beyond_its_noise_outweighs_a_doubtful_belief():
    """Drafting steps measured paying beyond one standard error keep drafting on at that load
    while the policy reads each pass as a loss; at a load with no measured win, and with the
    rule switched off, those passes pause drafting as before."""
    def measured(policy: Policy, confident: float) -> VerifyLengthController:
        c = VerifyLengthController(policy, SpecStats())
        c.CONFIDENT_WIN = confident
        c.record_pass(1, 0.6)  # start-up
        c.record_pass(1, 0.01)  # the first timed pass: nothing to price it against yet
        for i in range(40):  # drafting: 2-3 tokens in 0.1 s; plain: 1 token in 0.07-0.09 s
            c.observe_outcome(1, True, 2 + i % 2, 0.1)
            c.observe_outcome(1, False, 1, 0.07 + 0.02 * (i % 2))
        return c

    c = measured(_Doubtful(), 1.0)
    low = c.measured_gain_bound(1, errors=-1.0)
    assert low > 1.0 and c._judged(0.8, 1) == pytest.approx(low)
    for _ in range(8):
        c.record_pass(1, 0.01)
    assert c.skip_steps == 0 and c.gain >= 1.0 and not c.paused()
    for _ in range(8):
        c.record_pass(2, 0.01, decodes=2)  # nothing measured at 2 requests: the belief pauses
    assert c.skip_steps > 0
    off = measured(_Doubtful(), 0.0)
    for _ in range(8):
        off.record_pass(1, 0.01)
    assert off.skip_steps > 0 and off.gain < 1.0
    assert off._judged(0.8, 1) == 0.8  # switched off, the belief caps the measurement


def test_a_probe_measures_an_unsure_loss_again_before_it_pauses_drafting_again():
    """A loss beyond one standard error but within two pauses drafting; at the probe after the
    pause (the policy still expecting a gain) that loss is measured again from fresh drafting
    steps, which here pay, so drafting goes on. A loss beyond two errors pauses again at once."""
    def paused_by(seconds: float) -> VerifyLengthController:
        c = _measured([1, 1, 2, 1, 1], seconds)
        while c.skip_steps == 0:
            c.record_pass(1, 0.01)
        while c.paused():  # the pause runs out (the policy expects a gain: no extension)
            c.observe_outcome(1, False, 1, 0.08)
        return c

    unsure = paused_by(0.105)
    assert unsure.measured_gain_bound(1) < 1.0 <= unsure.measured_gain_bound(1, errors=2.0)
    unsure.record_pass(1, 0.01)  # the probe
    assert unsure.skip_steps == 0 and unsure.measured_gain(1) is None  # measured again first
    for _ in range(unsure.MEASURED_MIN):  # fresh drafting steps: 3 tokens in 0.1 s
        assert not unsure.paused()
        unsure.observe_outcome(1, True, 3, 0.1)
        unsure.record_pass(1, 0.01)
    assert unsure.measured_gain(1) > 1.0 and unsure.skip_steps == 0 and not unsure.paused()

    clear = paused_by(0.14)
    assert clear.measured_gain_bound(1, errors=2.0) < 1.0
    clear.record_pass(1, 0.01)  # the probe: the loss stands, drafting pauses again
    assert clear.skip_steps > 0 and clear.measured_gain(1) is not None


def test_paused_steps_stop_verifying_looked_up_chains_where_they_measured_a_loss():
    c = VerifyLengthController(Policy(), SpecStats())
    assert c.lookups_pay(4)  # nothing measured: the policy's pricing decides
    for _ in range(c.MEASURED_MIN):  # paused steps with looked-up chains: 4 tokens in 0.05 s
        assert c.lookups_pay(4)
        c.observe_lookups(4, 4, 0.05)
    assert not c.lookups_pay(4)  # then plain steps to measure against ...
    for _ in range(c.MEASURED_MIN):
        c.observe_outcome(4, False, 4, 0.04)  # ... 4 tokens in 0.04 s: the lookups lose
    assert c.measured_gain(4, "lookup") == pytest.approx(0.8)
    tried = [c.lookups_pay(4) for _ in range(2 * c.LOOKUP_RETRY)]
    assert sum(tried) == 2  # one step in LOOKUP_RETRY still tries them
    assert sum(c.lookups_pay(8) for _ in range(c.LOOKUP_RETRY)) == 1  # a loss at 4 holds at 8
    assert all(c.lookups_pay(2) for _ in range(4))  # but not at 2
    for _ in range(c.MEASURED_MIN):  # at 2 they pay
        c.observe_lookups(2, 3, 0.05)
        c.observe_outcome(2, False, 2, 0.05)
    assert c.measured_gain(2, "lookup") > 1 and c.lookups_pay(2)

def test_drafter_pass_time_falls_faster_than_it_rises():
    c = VerifyLengthController(Policy(), SpecStats())
    c.record_pass(1, 0.5)  # start-up: not timed
    c.record_pass(1, 0.008)  # the second pass may still carry set-up costs
    for _ in range(3):
        c.record_pass(1, 0.002)
    assert c.draft_seconds[1] < 0.003  # 0.008 -> 0.005 -> 0.0035 -> 0.00275
    c.record_pass(1, 0.012)  # one slow pass (a busy machine) moves it a fifth of the way
    assert c.draft_seconds[1] == pytest.approx(0.00275 + 0.2 * (0.012 - 0.00275))


def test_controller_resumes_a_pause_when_the_load_falls_to_where_drafting_pays():
    class ByLoad(Policy):  # drafting pays below 4 requests, loses at 4 and above
        last_gain = None

        def choose(self, budgets, conf, other_tokens=0, draft_seconds=0.0, max_total=None):
            self.last_gain = 1.5 if len(budgets) < 4 else 0.5
            return list(budgets)

    c = VerifyLengthController(ByLoad(), SpecStats())
    for _ in range(3):  # the first passes are not judged; the third loses at 16 requests
        c.policy.choose([8] * 16, None)
        c.record_pass(16, 0.01)
    assert c.skip_steps == c.MIN_BACKOFF and c.lost_at == 16 and c.gain < 1
    assert c.paused(16, 8) and c.paused(8, 8)  # fewer requests, but drafting still loses there
    assert c.skip_steps == c.MIN_BACKOFF - 2
    assert not c.paused(2, 8)  # at 2 requests the policy expects a gain: the pause ends now
    assert c.skip_steps == 0 and c.gain == 1.0
    assert c.backoff == 2 * c.MIN_BACKOFF  # kept: if drafting loses there too, the next pause is longer


def test_controller_extends_a_pause_without_probing_while_drafting_is_expected_to_lose():
    class Losing(Policy):
        last_gain = 0.5  # every pass loses, and so does every expectation

    c = VerifyLengthController(Losing(), SpecStats())
    for _ in range(3):
        c.record_pass(16, 0.01)
    steps, probes = 0, 0
    while probes == 0:  # only the pause steps count until the first real probe
        if c.paused(16, 8):
            steps += 1
        else:
            probes += 1
    # every pause ran out expecting a loss and doubled, 4 + 8 + ... + 128 steps, until the back-off
    # reached its longest: then a real probe
    assert steps == sum(c.MIN_BACKOFF * 2 ** i for i in range(6))
    assert c.backoff == c.MAX_BACKOFF and c.num_draft_passes == 3


def test_sibling_trees_hold_the_chain_and_its_alternatives():
    from dspark.engine.proposers.chain_walk import SiblingTree

    seqs = [type("S", (), {"grammar": None})()]
    walk = SiblingTree(seqs, 8, None, topk=2, budget=4)
    walk.pick(torch.tensor([[0.0, 3.0, 2.0, -9, -9, -9, -9, -9]]))  # chain 1, sibling 2
    walk.pick(torch.tensor([[0.0, -9, -9, 4.0, 3.9, -9, -9, -9]]))  # chain 3, sibling 4 (under 1)
    walk.pick(torch.tensor([[5.0, -9, -9, -9, -9, -9, -9, 4.0]]))  # chain 0, sibling 7 (under 3)
    (d,) = walk.drafts([3])
    t = d.tree
    assert d.num_proposed == 4 and len(t) == 4  # 6 nodes, the 4 likeliest kept
    by_token = dict(zip(t.tokens, zip(t.parents, t.depths)))
    assert by_token[1] == (0, 1) and by_token[3] == (t.tokens.index(1) + 1, 2)
    assert all(t.scores[t.parents[i] - 1] >= t.scores[i] for i in range(len(t)) if t.parents[i])
    shallow = SiblingTree(seqs, 8, None, topk=2, budget=4)
    shallow.pick(torch.tensor([[0.0, 3.0, 2.0, -9, -9, -9, -9, -9]]))
    shallow.pick(torch.tensor([[0.0, -9, -9, 4.0, 3.9, -9, -9, -9]]))
    assert shallow.drafts([1])[0].tree.depths == [1, 1]  # a request's budget bounds its depth


def test_draft_probs_in_verification_come_only_from_the_proposal():
    from dspark.engine.verify import Work, _draft_probs

    q = torch.softmax(torch.randn(2, 6), -1)
    works = [Work(None, "decode", [0, 1, 2], drafts=[1, 2], q=q), Work(None, "decode", [0, 4], drafts=[4])]
    out = _draft_probs(works, 2, 6, torch.device("cpu"))
    assert torch.equal(out[0], q) and out[1, 0, 4] == 1 and out[1, 0].sum() == 1 and out[1, 1].sum() == 0
    assert _draft_probs([works[1]], 1, 6, torch.device("cpu")) is None  # all one-hot: greedy-style accept


# ---------------------------------------------------------------- through the engine
KINDS = {"eagle3": {"drafter": "eagle3_agree"}, "draft-model": {"drafter": None, "draft_model": "draft_model"}}


def _engine(folders, kind: str, **kwargs):
    spec = {k: folders.get(v, v) if isinstance(v, str) else v for k, v in KINDS[kind].items()}
    return make_engine(folders["target"], **spec, **kwargs)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("assist,tree", [(0, False), (2, False), (0, True), (2, True)],
                         ids=["chain", "chain+assist", "tree", "tree+assist"])
def test_greedy_speculation_equals_plain_decoding(folders, kind, assist, tree):
    prompts = alphabet_prompts([15, 16, 17, 31, 33, 40], seed=3)
    engine = _engine(folders, kind, ngram_assist=assist, block_size=4, tree=tree, tree_budget=6, tree_topk=3)
    reqs = [(p, GREEDY, None) for p in prompts]
    spec = run_requests(engine, reqs)
    plain = run_requests(make_engine(folders["target"]), reqs)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    st = engine.spec_stats
    assert engine.spec.name == kind and st.verified > 0 and st.proposed >= st.verified
    if kind == "draft-model":  # another predictable target: it agrees with this one often, not always
        assert st.verified / 8 < st.accepted < st.verified, st.as_dict()
    else:  # the agreeing head: right at its first position about a third of the time, ~1% if misfed
        assert st.accepted_per_pos[0] > st.verified_per_pos[0] / 8 and st.accepted < st.verified, st.as_dict()


def test_a_target_drafting_for_itself_is_accepted_throughout(folders):
    """The target as its own draft model proposes exactly its own greedy tokens, so every draft
    survives unless the draft cache went stale (accepted drafts it never fed, rejected ones left
    behind): a check of that cache's bookkeeping."""
    prompts = alphabet_prompts([15, 33, 40], seed=5)
    engine = make_engine(folders["target"], None, draft_model=folders["target"], block_size=5, ngram_assist=0)
    spec = run_requests(engine, [(p, GREEDY, None) for p in prompts])
    plain = run_requests(make_engine(folders["target"]), [(p, GREEDY, None) for p in prompts])
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    st = engine.spec_stats
    assert st.accepted >= 0.97 * st.verified, st.as_dict()


def test_draft_model_drafts_after_a_preemption_and_under_mixed_budgets(folders):
    """A small cache preempts requests (their draft cache is rebuilt from scratch) and requests near
    max_tokens draft fewer tokens than the others in the same pass: output stays plain decoding's."""
    prompts = alphabet_prompts([31, 33, 40], seed=9)
    reqs = [(p, dataclasses.replace(GREEDY, max_tokens=m), None) for p, m in zip(prompts, [60, 7, 60])]
    engine = _engine(folders, "draft-model", kv_cache_tokens=16 * 10, max_num_batched_tokens=40, block_size=6)
    spec = run_requests(engine, reqs)
    plain = run_requests(make_engine(folders["target"]), reqs)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.num_preemptions > 0


def _counting(fn, log: list, what):  # noqa: ANN001, ANN202 - wraps any callable
    """fn, appending what(*args) to log on every call."""
    def call(*args):  # noqa: ANN002, ANN202
        log.append(what(*args))
        return fn(*args)
    return call


def test_draft_model_stops_a_chain_whose_survival_falls_below_p_min(folders):
    """draft_p_min: a chain stops growing once the product of its tokens' draft probabilities
    falls below it, so each draft takes fewer passes of the draft model and proposes fewer
    tokens; output stays plain decoding's."""
    prompts = alphabet_prompts([15, 33, 40], seed=6)
    reqs = [(p, GREEDY, None) for p in prompts]
    plain = run_requests(make_engine(folders["target"]), reqs)
    per_draft = {}
    for p_min in (0.0, 0.9):
        engine = _engine(folders, "draft-model", block_size=6, ngram_assist=0, draft_p_min=p_min)
        proposer, passes, drafts = engine.spec.proposer, [], []
        proposer._run = _counting(proposer._run, passes, lambda *a: 1)
        proposer.draft = _counting(proposer.draft, drafts, lambda seqs, budgets: len(seqs))
        out = run_requests(engine, reqs)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
        st = engine.spec_stats
        per_draft[p_min] = (len(passes) / len(drafts), st.proposed / sum(drafts))
    # without a floor every draft walks its whole block (fewer tokens only near max_tokens)
    assert per_draft[0.0][0] > 5.5 and per_draft[0.0][1] > 5.5, per_draft
    assert per_draft[0.9][0] < 0.8 * per_draft[0.0][0] and per_draft[0.9][1] < 0.8 * per_draft[0.0][1], per_draft
    with pytest.raises(ValueError, match="draft_p_min"):
        SpecConfig(draft_p_min=1.0).validate()


def test_eagle3_sampled_drafts_carry_q_over_the_target_vocabulary(folders):
    engine = _engine(folders, "eagle3", block_size=3, ngram_assist=0)
    seen = []
    real = engine.spec.proposer.draft

    def recording(seqs, budgets):
        out = real(seqs, budgets)
        seen.extend(out)
        return out

    engine.spec.proposer.draft = recording
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=12)
    run_requests(engine, [(p, sp, None) for p in alphabet_prompts([20, 25], seed=4)])
    assert seen and all(d.q is not None and d.q.shape[0] == len(d.tokens) for d in seen)
    allowed = engine.spec.proposer.to_target
    for d in seen:  # q is 0 outside the head's draft vocabulary, and sums to 1
        outside = torch.ones(d.q.shape[-1], dtype=torch.bool)
        outside[allowed] = False
        assert float(d.q[:, outside].sum()) == 0 and torch.allclose(d.q.sum(-1), torch.ones(len(d.tokens)))


# ---------------------------------------------------------------- checkpoints and errors
def test_eagle3_checkpoint_has_the_published_layout(folders):
    from safetensors import safe_open

    with safe_open(f"{folders['eagle3']}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    for k in ("fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
              "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
              "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
              "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
              "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"):
        assert k in keys, k
    cfg = json.loads(open(f"{folders['eagle3']}/config.json").read())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 17 + 24
    with safe_open(f"{folders['eagle3']}/model.safetensors", "pt") as f:
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * cfg["hidden_size"]


def test_eagle3_for_another_target_is_a_clear_error(folders):
    with pytest.raises(ValueError, match="vocab 12 != target vocab 49152"):
        make_engine(folders["target"], folders["small_eagle3"])


def test_draft_model_with_another_vocabulary_is_a_clear_error(folders):
    with pytest.raises(ValueError, match=r"draft model vocabulary \(12 tokens\) differs from the target's \(49152\)"):
        make_engine(folders["target"], None, draft_model=folders["small_draft_model"])


def test_draft_model_with_another_tokenizer_is_a_clear_error():
    from dspark.engine.proposers.draft_model import check_same_tokenizer

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    check_same_tokenizer(Tok({"a": 0, "b": 1}), Tok({"a": 0, "b": 1}), 2, 2)
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_same_tokenizer(Tok({"a": 1, "b": 0}), Tok({"a": 0, "b": 1}), 2, 2)


def test_conflicting_settings_are_clear_errors(folders, tmp_path):
    with pytest.raises(ValueError, match="drafter and draft_model are exclusive"):
        SpecConfig(drafter="ngram", draft_model=folders["draft_model"]).validate()
    with pytest.raises(ValueError, match="does not exist"):
        SpecConfig(draft_model=str(tmp_path / "nowhere")).validate()
