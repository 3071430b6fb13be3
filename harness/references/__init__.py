"""harness/references"""
