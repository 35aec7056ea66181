"""Structured outputs: JSON schemas, regexes, choices and grammars as token constraints
(`jlco.sampling.constraint.TokenConstraint`) over a served tokenizer, with llguidance as
the grammar engine (`grammar`), the request fields that ask for them (`request`), and the
schemas behind forced tool calls (`tools`). It may import jlco.sampling (the constraint
interface) and llguidance; the server imports it."""
