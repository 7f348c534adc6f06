"""Speculative decoding on the Ascend platform: the methods it runs (MTP, n-gram) and
the start-up check that refuses the others (``config``)."""
