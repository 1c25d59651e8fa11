"""Per-step log of a dspark server: put this folder on PYTHONPATH and set STEPLOG to a file."""
import json
import os
import time

if os.environ.get("STEPLOG"):
    from dspark.engine import engine as _eng

    _real = _eng.Engine.step
    _f = open(os.environ["STEPLOG"], "a")  # noqa: SIM115 - open for the server's lifetime

    def step(self):  # noqa: ANN001, ANN201
        plan = self.planner.plan
        got = {}

        def spied():  # noqa: ANN202
            d, p = plan()
            got["dec"] = len(d)
            got["ptok"] = sum(n for _, n in p)
            got["res"] = sum(self.spec.max_tokens_for(s) for s in d)
            return d, p

        self.planner.plan = spied
        t = time.perf_counter()
        out = _real(self)
        ms = 1e3 * (time.perf_counter() - t)
        del self.planner.plan
        if got.get("dec"):
            pred = 1e3 * self.cost(got["res"] + got["ptok"]) if self.cost is not None else None
            c = self.spec.controller
            row = {"ms": round(ms, 1), **got, "pred": pred and round(pred, 1), "passed": self.spec.passed,
                   "paused": self.spec.paused, "skip": getattr(c, "skip_steps", None),
                   "lost_at": getattr(c, "lost_at", None)}
            _f.write(json.dumps(row) + "\n")
            _f.flush()
        return out

    _eng.Engine.step = step
