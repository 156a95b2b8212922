"""Data: a user's files -> checked rows -> tokens and targets as at inference -> packed, padded micro-batches.
Imports only the modules at the bottom of common/ (refusal, strict_reading)."""
