"""harness/results"""
