"""A per-step log of every dspark engine in a process (a server, or any command), loaded by Python
at start-up when this folder is on PYTHONPATH:

    PYTHONPATH=scripts/steplog STEPLOG=/tmp/steps bash scripts/serve_ab.sh ...

Each process appends one JSON line per step with decoding requests to <STEPLOG>.<pid>.jsonl:
- t, ms: when the step ended (epoch s) and its wall time;
- dec, ptok: decoding requests and prefill tokens;
- res, priced, pred: the slots the decodes reserved, the target-pass tokens they were priced at
  (SpecRunner.priced_tokens_for), and the cost model's ms for priced + ptok (the decode-stall
  bound's prediction before its prefill scale; None without a cost model);
- fw, rows: the target pass's wall ms (the model runner's forward) and its logit rows;
- ds: of that, ms in the fused decoder-stack kernel (the target's; 0 where it does not run);
- out: tokens the decoding requests committed in the step;
- scale, gain, belief, dsec, cost: the planner's prefill scale, the controller's running gain,
  the policy's last expected gain, the drafter pass ms by batch, the cost model's ms at 1, 4, 8,
  16 and 32 tokens;
- rates: the controller's measured [tok/s, steps, square] at this many decoding requests for
  drafting, plain and lookup-verifying steps;
- ctxw, ctxrows: ms and rows of drafter-context writes in the step (DrafterContext._write);
- passed, paused, verified: whether a drafter pass ran, drafting was paused, and anything past
  the anchors was verified;
- drafter, skip, lost_at: the drafter's name and the controller's pause state.

Without STEPLOG nothing is patched. Used for the step logs in results/bench/twelfth/ and
results/bench/thirteenth/ (those logged a subset of these fields)."""
import json
import os
import time

if os.environ.get("STEPLOG"):
    from dspark.engine import drafter_context as _dc
    from dspark.engine import engine as _eng
    from dspark.engine import model_runner as _mr
    from dspark.models import cpu_ops as _cpu_ops

    _real_step, _real_forward = _eng.Engine.step, _mr.ModelRunner.forward
    _real_write = _dc.DrafterContext._write
    _f = open(os.environ["STEPLOG"] + f".{os.getpid()}.jsonl", "a")  # noqa: SIM115 - the process's lifetime
    _box = {}

    def forward(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        t = time.perf_counter()
        out = _real_forward(self, *args, **kwargs)
        _box["fw"], _box["rows"] = time.perf_counter() - t, len(args[1])
        return out

    def write(self, steps):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = _real_write(self, steps)
        _box["ctxw"] = _box.get("ctxw", 0.0) + time.perf_counter() - t
        _box["ctxrows"] = _box.get("ctxrows", 0) + sum(n for _, e in steps for *_, n in e)
        return out

    _dc.DrafterContext._write = write
    _ops = _cpu_ops.load()
    if _ops is not None and hasattr(_ops, "decode_stack"):
        _real_stack = _ops.decode_stack

        def decode_stack(h, weights, *rest):  # noqa: ANN001, ANN002, ANN202
            t = time.perf_counter()
            out = _real_stack(h, weights, *rest)
            if len(weights) > 100:  # the target's stack (a drafter's two layers carry far fewer tensors)
                _box["ds"] = _box.get("ds", 0.0) + time.perf_counter() - t
            return out

        _ops.decode_stack = decode_stack

    def step(self):  # noqa: ANN001, ANN201
        plan, got = self.planner.plan, {}

        def spied():  # noqa: ANN202
            d, p = plan()
            got["dec"], got["ptok"] = len(d), sum(n for _, n in p)
            got["res"] = sum(self.spec.max_tokens_for(s) for s in d)
            got["priced"] = sum(self.spec.priced_tokens_for(s) for s in d)
            got["_seqs"] = [(s, len(s.output_ids)) for s in d]
            return d, p

        self.planner.plan = spied
        _box.clear()
        t = time.perf_counter()
        out = _real_step(self)
        ms = 1e3 * (time.perf_counter() - t)
        del self.planner.plan
        if got.get("dec"):
            got["out"] = sum(len(s.output_ids) - n for s, n in got.pop("_seqs"))
            pred = 1e3 * self.cost(got["priced"] + got["ptok"]) if self.cost is not None else None
            c = self.spec.controller
            pol = self.spec.policy
            row = {"t": round(time.time(), 3), "ms": round(ms, 2), **got, "pred": pred and round(pred, 1),
                   "fw": round(1e3 * _box.get("fw", 0), 2), "rows": _box.get("rows"),
                   "ds": round(1e3 * _box.get("ds", 0), 2), "ctxw": round(1e3 * _box.get("ctxw", 0), 2),
                   "ctxrows": _box.get("ctxrows", 0), "passed": self.spec.passed,
                   "paused": self.spec.paused, "verified": self.spec.verified, "drafter": self.spec.name,
                   "skip": getattr(c, "skip_steps", None), "lost_at": getattr(c, "lost_at", None),
                   "scale": round(getattr(self.planner, "prefill_scale", 1.0), 3),
                   "gain": c and round(c.gain, 3), "belief": c and round(getattr(pol, "last_gain", 0) or 0, 3),
                   "dsec": c and {k: round(1e3 * v, 2) for k, v in c.draft_seconds.items()},
                   "cost": self.cost and [round(1e3 * self.cost(n), 2) for n in (1, 4, 8, 16, 32)],
                   "rates": c and [c.rates.get((got["dec"], k)) for k in (True, False, "lookup")]}
            _f.write(json.dumps(row) + "\n")
            _f.flush()
        return out

    _mr.ModelRunner.forward = forward
    _eng.Engine.step = step
