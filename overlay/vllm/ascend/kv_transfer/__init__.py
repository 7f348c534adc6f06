"""P2P disaggregated prefill: the transfer plan and its wire types (the connector builds on them)."""
