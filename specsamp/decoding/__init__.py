"""The decoding loop, from a draft string to a `Completion`.

Read in this order: `config` (SamplingParams, `KChoice` (K, fixed or auto), the draft
string), `sampling` (logits -> probabilities), `acceptance` (the rejection rule), `state`
(the loop's arrays), `drafters` and `lookup` (what proposes draft tokens; `drafts` names
the shipped ones, `factory` builds one from a draft string), `decode` (the compiled
programs: insert, and `generate`, the one round program, plain or speculative rounds at a
K), `shapes` (prompt buckets, prefill groups), `costs` and `kpolicy` (round costs and the
`--k auto` policy), `rounds` (a row's round log, `RawSample`), `batching` (the host runner:
`Static` and `Continuous` batching as policies of it), `engine` (`Engine`: the device API
and `run`), `results` (per-sample statistics), `generator` (the text API,
`load_generator`). `stats` holds the statistics' formulas (acceptance rate, alpha,
expected tokens per round, predicted speed-up), used by the loop and by the reports.
Token trees (building blocks, not yet in the loop): `tree` (a static tree of parent indices,
its tables and the scoring block's attention mask) and `tree_acceptance` (the exact rules
over a tree: greedy, and children drawn with or without replacement or fixed).
"""
