"""Per-step log of a dspark server: put this folder on PYTHONPATH and set STEPLOG to a path prefix;
each server process appends JSON lines to <prefix>.<pid>.jsonl (the target pass's own time, its
rows, and whether the step drafted, was paused, or verified looked-up chains)."""
import json
import os
import time

if os.environ.get("STEPLOG"):
    from dspark.engine import engine as _eng
    from dspark.engine import model_runner as _mr

    _real_step, _real_forward = _eng.Engine.step, _mr.ModelRunner.forward
    _f = open(os.environ["STEPLOG"] + f".{os.getpid()}.jsonl", "a")  # noqa: SIM115 - the server's lifetime
    _box = {}

    def forward(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        t = time.perf_counter()
        out = _real_forward(self, *args, **kwargs)
        _box["fw"], _box["rows"] = time.perf_counter() - t, len(args[1])
        return out

    def step(self):  # noqa: ANN001, ANN201
        plan, got = self.planner.plan, {}

        def spied():  # noqa: ANN202
            d, p = plan()
            got["dec"], got["ptok"] = len(d), sum(n for _, n in p)
            return d, p

        self.planner.plan = spied
        _box.clear()
        t = time.perf_counter()
        out = _real_step(self)
        ms = 1e3 * (time.perf_counter() - t)
        del self.planner.plan
        if got.get("dec"):
            row = {"t": round(time.time(), 3), "ms": round(ms, 2), **got, "fw": round(1e3 * _box.get("fw", 0), 2),
                   "rows": _box.get("rows"), "ds": round(1e3 * _box.get("ds", 0), 2),
                   "passed": self.spec.passed, "paused": self.spec.paused,
                   "verified": self.spec.verified, "drafter": self.spec.name}
            _f.write(json.dumps(row) + "\n")
            _f.flush()
        return out

    _mr.ModelRunner.forward = forward
    from dspark.models import cpu_ops as _co
    _ops = _co.load()
    if _ops is not None and hasattr(_ops, "decode_stack"):
        _ds = _ops.decode_stack

        def decode_stack(h, w, *rest):  # noqa: ANN001, ANN002, ANN202
            t = time.perf_counter()
            out = _ds(h, w, *rest)
            if len(w) > 100:
                _box["ds"] = _box.get("ds", 0.0) + time.perf_counter() - t
            return out

        _ops.decode_stack = decode_stack
    _eng.Engine.step = step
