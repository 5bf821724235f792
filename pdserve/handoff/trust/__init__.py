"""Who may move K/V: the router's signed transfer capabilities and their check by the memory
owner on every handoff link (docs/security.md)."""
