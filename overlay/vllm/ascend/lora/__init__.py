"""LoRA on Ascend: the punica wrapper the platform names (``get_punica_wrapper``)."""
