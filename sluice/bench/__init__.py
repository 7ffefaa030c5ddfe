"""sluice.bench"""
