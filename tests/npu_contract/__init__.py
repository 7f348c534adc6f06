"""The torch_npu contract double (``site/torch_npu``) and the tests that keep it honest."""
