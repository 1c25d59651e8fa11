"""TTFT of three chats sharing a 746-token system prompt, with and without --enable-prefix-caching."""
import time
from dspark.llm import LLM
from dspark.config import SamplingParams
text = open("README.md").read()[:2400]
for caching in (False, True):
    llm = LLM(enable_prefix_caching=caching)
    sp = SamplingParams(temperature=0, max_tokens=8)
    outs = []
    for i in range(3):
        o = llm.generate([[{"role": "system", "content": text}, {"role": "user", "content": f"Question {i}: what is dspark?"}]], sp)[0]
        outs.append(o)
    print("prefix caching", caching, "prompt tokens", len(outs[0].prompt_token_ids),
          "ttft ms", [round(o.ttft * 1000) for o in outs], "hits", llm.engine.pool.prefix_hits, "of", llm.engine.pool.prefix_queries)
