"""harness/assembly"""
