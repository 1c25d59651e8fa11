"""Tau of the shipped drafter on six JSON requests, free and under a JSON schema (greedy; chains,
or trees of 8 nodes with --tree)."""

import json
import sys

from dspark.config import SamplingParams, StructuredOutputs
from dspark.llm import LLM

SCHEMA = {"type": "object", "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}}}}
tree = "--tree" in sys.argv
llm = LLM(tree=tree, tree_budget=8, policy="fixed")  # tau of the drafter, every draft verified
stats = llm.engine.spec_stats
prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON with name, age, city and hobbies."}]
           for i in range(6)]
for so in (None, StructuredOutputs(json=json.dumps(SCHEMA))):
    before = (stats.generated, stats.steps)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=80, structured_outputs=so))
    tau = (stats.generated - before[0]) / (stats.steps - before[1])
    print("tree" if tree else "chain", "schema" if so else "free", "tau", round(tau, 3))
