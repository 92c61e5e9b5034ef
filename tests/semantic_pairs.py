"""A small labelled set for the semantic cache, written for the tests: paraphrases that should share an
answer, and near-misses that look alike but ask something else (a hit there is a wrong answer)."""

PARAPHRASES = [
    ("What is the capital of France?", "What's the capital city of France?"),
    ("How do I reverse a list in Python?", "How can I reverse a Python list?"),
    ("What is the boiling point of water?", "At what temperature does water boil?"),
    ("Who wrote Romeo and Juliet?", "Who is the author of Romeo and Juliet?"),
    ("How many days are there in a leap year?", "How many days does a leap year have?"),
    ("What is the tallest mountain in the world?", "Which mountain is the highest in the world?"),
    ("Translate 'good morning' into Spanish.", "How do you say 'good morning' in Spanish?"),
    ("What is the speed of light?", "How fast does light travel?"),
    ("Give me a recipe for pancakes.", "How do I make pancakes?"),
    ("What does HTTP stand for?", "What is HTTP short for?"),
    ("How do I convert Celsius to Fahrenheit?", "What is the formula to convert Celsius into Fahrenheit?"),
    ("What is the largest planet in the solar system?", "Which planet in our solar system is the biggest?"),
]
NEAR_MISSES = [
    ("What is the capital of France?", "What is the capital of Germany?"),
    ("How do I reverse a list in Python?", "How do I sort a list in Python?"),
    ("What is the boiling point of water?", "What is the freezing point of water?"),
    ("Who wrote Romeo and Juliet?", "Who wrote Hamlet?"),
    ("How many days are there in a leap year?", "How many days are there in February?"),
    ("What is the tallest mountain in the world?", "What is the longest river in the world?"),
    ("Translate 'good morning' into Spanish.", "Translate 'good morning' into French."),
    ("What is the speed of light?", "What is the speed of sound?"),
    ("Give me a recipe for pancakes.", "Give me a recipe for waffles."),
    ("What does HTTP stand for?", "What does HTML stand for?"),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?"),
    ("What is the largest planet in the solar system?", "What is the smallest planet in the solar system?"),
]
