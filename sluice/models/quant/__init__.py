"""sluice.models.quant"""
