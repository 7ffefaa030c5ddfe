"""sluice.engine"""
