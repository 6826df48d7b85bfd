"""Deployment: MindIR prefill/decode graphs, converter_lite configs for Ascend, parity checks."""
from mindqwen.export.mindir import check_parity, deploy_copy, export_model

__all__ = ["check_parity", "deploy_copy", "export_model"]
