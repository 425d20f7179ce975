"""A reward plugin loaded by config (see docs/rewards.md)."""
