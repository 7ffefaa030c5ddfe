"""sluice.server"""
