"""Structured output: constraints (a regular expression, a JSON schema, any JSON object, a choice among strings)
compiled to token-level automata whose tables live on the device, so that a constrained request's mask for step
N + 1 is gathered on the device from the state its token N reached: no host sync, the overlap loop and speculative
verification unchanged (docs/INTERNALS.md, "Structured output").

- ``spec``: what a request asks for (``Constraint``), checked and turned into one regular expression; JSON schema
  keywords the automaton cannot enforce are refused by name.
- ``automaton``: the regular expression against the tokenizer's vocabulary (outlines-core's token index), as flat
  arrays: each state's allowed-token bitmask (deduplicated) and its transitions; compiled once per constraint and
  tokenizer, cached.
- ``tables``: the device side: every live automaton in one table, each request slot's current state, the mask of a
  batch's rows, the state after their tokens, the states along a verify row's drafts.
"""
