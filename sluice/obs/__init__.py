"""sluice.obs"""
