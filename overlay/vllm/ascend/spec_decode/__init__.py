"""Speculative decoding on the Ascend platform (DeepSeek MTP): what is accepted at start-up."""
