"""The slow half of compiling a constraint, run in a child process: outlines-core's ``Index`` of a regular
expression over the vocabulary, flattened into the arrays of a ``TokenAutomaton``.

Building the index cannot be stopped once started, and some small expressions need time and memory exponential in
their size (``(a|b)*a(a|b){25}``; a JSON schema of arrays nested eight deep took 25 s and 1.7 GB, nine deep ran out
of memory). In the server's process such a request would take every other request down with it; in a child process
with a memory cap and a time limit it is refused on its own (``automaton.compile_automaton``).

This file imports nothing of hylo (numpy and outlines-core only), so that the child starts in a fraction of a
second: it is run as a script, reads one pickled job on stdin and writes one pickled result on stdout.
"""

from __future__ import annotations

import pickle
import sys

import numpy as np


def flatten_index(regex: str, vocab: int, vocabulary: dict[bytes, list[int]]) -> dict:
    """outlines-core's index of ``regex`` over ``vocabulary`` (logits of width ``vocab``) as flat arrays: states
    renumbered 0..S-1, the sorted keys ``state * vocab + token`` of every allowed pair and the state each leads to,
    one bitmask row per distinct allowed set (``mask_of`` points at it), and which states are final. A ValueError
    where outlines-core refuses the expression."""
    from outlines_core import Index, Vocabulary

    try:
        # the end-of-sequence id outlines wants is one no token has: the device tables allow the model's own
        index = Index(regex, Vocabulary(vocab, vocabulary))
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(str(e).strip() or type(e).__name__) from None  # (the caller keeps its first line)
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    order = {s: i for i, s in enumerate(sorted(set(transitions) | finals | {index.get_initial_state()}))}
    words = (vocab + 31) // 32
    keys, nexts, rows = [], [], []
    for state, local in order.items():
        moves = {t: n for t, n in transitions.get(state, {}).items() if t < vocab}
        tokens = np.fromiter(moves.keys(), dtype=np.int64, count=len(moves))
        targets = np.fromiter((order[n] for n in moves.values()), dtype=np.int32, count=len(moves))
        sort = np.argsort(tokens)
        keys.append(local * vocab + tokens[sort])
        nexts.append(targets[sort])
        bits = np.zeros(words * 32, dtype=np.uint8)
        bits[tokens] = 1
        rows.append(np.packbits(bits, bitorder="little").view(np.int32))
    masks, mask_of = np.unique(np.stack(rows), axis=0, return_inverse=True)
    final = np.zeros(len(order), dtype=bool)
    final[[order[s] for s in finals]] = True
    return dict(initial=order[index.get_initial_state()], keys=np.concatenate(keys), next_state=np.concatenate(nexts),
                masks=np.ascontiguousarray(masks), mask_of=mask_of.astype(np.int32).reshape(-1), final=final)


def main() -> None:
    job = pickle.load(sys.stdin.buffer)
    if job.get("memory_bytes"):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (job["memory_bytes"], job["memory_bytes"]))
    try:
        result = {"ok": flatten_index(job["regex"], job["vocab"], job["vocabulary"])}
    except ValueError as e:
        result = {"error": str(e)}
    except MemoryError:
        result = {"memory": True}
    pickle.dump(result, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)


if __name__ == "__main__":
    main()
