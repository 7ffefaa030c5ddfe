"""sluice.models"""
