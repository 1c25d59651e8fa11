"""The greedy shortcut in verify.accept (argmax per verified row) against the general path it
replaces (one-hot target probabilities through rejection sampling), chains and trees, with ties."""

from __future__ import annotations

import torch

from dspark.config import SamplingParams
from dspark.engine.sampling import accept_chain, warp_logits
from dspark.engine.tree import DraftTree, accept_trees
from dspark.engine.verify import Work, _accept_greedy


class _Seq:
    params = SamplingParams(temperature=0.0)


def _greedy_p(logits: torch.Tensor) -> torch.Tensor:
    zeros = torch.zeros(logits.shape[:-1])
    return warp_logits(logits, zeros, zeros.long(), zeros + 1)


def test_greedy_chain_matches_rejection_sampling():
    g = torch.Generator().manual_seed(0)
    V, K = 6, 5
    for trial in range(300):
        logits = torch.randint(0, 3, (K + 1, V), generator=g).float()  # many ties on purpose
        best = logits.argmax(-1)
        n = int(torch.randint(0, K + 1, (1,), generator=g))
        # drafts that follow the argmax for a while, then (maybe) stray
        drafts = [int(best[i]) if torch.rand(1, generator=g) < 0.7 else int(torch.randint(0, V, (1,), generator=g))
                  for i in range(n)]
        w = Work(_Seq(), "decode", [0] + drafts, drafts)
        _accept_greedy(w, logits.argmax(-1).tolist())
        d = torch.tensor([drafts + [0] * (K - n)])
        n_acc, nxt = accept_chain(_greedy_p(logits[None]), d[:, :K], None, torch.tensor([n]),
                                  torch.full((1, K), 0.5), torch.tensor([0.5]))
        a = int(n_acc[0])
        assert w.new_tokens == drafts[:a] + [int(nxt[0])], trial
        assert w.kept_rows == list(range(a + 1))


def test_greedy_tree_matches_tree_walk():
    g = torch.Generator().manual_seed(1)
    V = 8  # > nodes - 1, so a parent always has a free token for another child
    for trial in range(200):
        parents, depths, tokens = [], [], []
        used: dict[int, set] = {}
        for _ in range(int(torch.randint(1, 9, (1,), generator=g))):
            par = int(torch.randint(0, len(tokens) + 1, (1,), generator=g))
            free = [t for t in range(V) if t not in used.setdefault(par, set())]
            tok = free[int(torch.randint(0, len(free), (1,), generator=g))]  # siblings differ, as top-k gives
            used[par].add(tok)
            parents.append(par)
            tokens.append(tok)
            depths.append(1 if par == 0 else depths[par - 1] + 1)
        tree = DraftTree(tokens, parents, depths)
        logits = torch.randint(0, 3, (len(tree) + 1, V), generator=g).float()
        w = Work(_Seq(), "decode", [0] + tokens, [], tree)
        _accept_greedy(w, logits.argmax(-1).tolist())
        D = max(depths)
        paths, nxt = accept_trees(_greedy_p(logits[None]), [tree], torch.full((1, D * (len(tree) + 1) + 1), 0.5))
        assert w.kept_rows == [0] + paths[0], trial
        assert w.new_tokens == [tokens[i - 1] for i in paths[0]] + [int(nxt[0])]
