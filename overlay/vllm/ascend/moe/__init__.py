"""MoE layer integration for Ascend (communication strategies come in a later issue)."""
