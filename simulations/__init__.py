"""The churn harness: traces of joins, leaves, crashes and bad links applied to real peers (its own issue)."""
