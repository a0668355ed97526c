"""contrib"""
