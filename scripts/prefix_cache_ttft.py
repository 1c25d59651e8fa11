"""TTFT of three chats sharing a 746-token system prompt, with and without --enable-prefix-caching."""

from dspark.config import SamplingParams
from dspark.llm import LLM

text = open("README.md").read()[:2400]
for caching in (False, True):
    llm = LLM(enable_prefix_caching=caching)
    sp = SamplingParams(temperature=0, max_tokens=8)
    outs = []
    for i in range(3):
        chat = [{"role": "system", "content": text}, {"role": "user", "content": f"Question {i}: what is dspark?"}]
        outs.append(llm.generate([chat], sp)[0])
    pool = llm.engine.pool
    print(f"prefix caching {caching}: {len(outs[0].prompt_token_ids)} prompt tokens, "
          f"ttft ms {[round(o.ttft * 1000) for o in outs]}, {pool.prefix_hits} of {pool.prefix_queries} tokens found")
