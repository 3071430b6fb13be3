"""harness/runs"""
