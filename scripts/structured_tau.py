"""Tau of the shipped drafter on six JSON requests, free and under a JSON schema (greedy, chains)."""

import json

from dspark.config import SamplingParams, StructuredOutputs
from dspark.llm import LLM

SCHEMA = {"type": "object", "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}}}}
llm = LLM()
stats = llm.engine.spec_stats
prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON with name, age, city and hobbies."}]
           for i in range(6)]
for so in (None, StructuredOutputs(json=json.dumps(SCHEMA))):
    before = (stats.generated, stats.steps)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=80, structured_outputs=so))
    print("schema" if so else "free", "tau", round((stats.generated - before[0]) / (stats.steps - before[1]), 3))
