"""The decoding loop, from a draft string to a `Completion`.

Read in this order: `config` (SamplingParams, K, the draft string), `sampling` (logits ->
probabilities), `acceptance` (the rejection rule), `state` (the loop's arrays), `drafters`
and `lookup` (what proposes draft tokens; `drafts` names the shipped ones, `factory` builds
one from a draft string), `decode` (the compiled autoregressive and speculative rounds), `engine` (host side on
token ids: compile, run, time), `rounds` and `results` (per-sample statistics), `generator`
(the text API, `load_generator`). Throughput: `continuous` (slots refilled as rows finish),
`costs` and `kpolicy` (`--k auto`). `stats` holds the statistics' formulas (acceptance rate,
alpha, expected tokens per round, predicted speed-up), used by the loop and by the reports.
Token trees (building blocks, not yet in the loop): `tree` (a static tree of parent indices,
its tables and the scoring block's attention mask) and `tree_acceptance` (the exact rules
over a tree: greedy, and children drawn with or without replacement or fixed).
"""
