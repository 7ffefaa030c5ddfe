"""sluice.gateway"""
