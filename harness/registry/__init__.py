"""harness/registry"""
