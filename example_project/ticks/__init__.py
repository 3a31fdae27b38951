"""The example's app: a singleton periodic job whose every run lands in a fenced ledger."""
