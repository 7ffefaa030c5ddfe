"""The schemas, tools and prompts of benchmarks/structured_validity.py: realistic requests of varied shape.

Each entry of ``SCHEMAS`` is a prompt, the schema its answer must match and a few words on its shape (the
table's column). Together they cover nested objects, arrays with ``minItems`` / ``maxItems``, enums and
``const``, ``anyOf``, anchored ``pattern`` strings, ``minLength`` / ``maxLength``, numbers and integers with
``minimum`` / ``maximum`` / ``exclusiveMinimum``, booleans, nulls, ``format`` (date, email, uuid, date-time),
``$defs`` with ``$ref``, optional properties and open objects (``additionalProperties`` left out).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMAS", "TOOLS", "TOOL_PROMPTS", "cold_schema"]


def obj(props: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if closed:
        s["additionalProperties"] = False
    return s


STR = {"type": "string"}
SHORT = {"type": "string", "minLength": 1, "maxLength": 40}
BOOL = {"type": "boolean"}
ADDRESS = obj({"street": SHORT, "city": SHORT, "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
               "country": {"enum": ["FR", "DE", "US", "GB", "JP"]}})  # fmt: skip

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "shape": "flat, ranged integer, email format",
        "prompt": "Extract the person: Alice Martin, 34 years old, alice.martin@example.com, works as a nurse.",
        "schema": obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "format": "email"}, "occupation": SHORT}, ["name", "age", "email"]),
    },
    "order": {
        "shape": "nested object, array 1-3, pattern, anyOf null",
        "prompt": "Record this order: ABC-123456 from Hans in DE, 2 widgets (WID-1) at 9.99 and 1 gadget (GAD-7) at 24.50, paid.",
        "schema": obj({
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
            "customer": obj({"name": SHORT, "country": {"enum": ["FR", "DE", "US", "JP"]}}),
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
                "sku": {"type": "string", "maxLength": 8}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                "price": {"type": "number", "minimum": 0}})},
            "paid": BOOL,
            "notes": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]}}),
    },
    "invoice": {
        "shape": "nested address, array 1-5 of lines, ranged numbers, date",
        "prompt": "Make an invoice for Acme Ltd, 12 High Street, London, postcode 10001, GB, dated 2024-03-15, "
                  "for 3 hours of consulting at 120 and one licence at 499.",
        "schema": obj({"invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                       "date": {"type": "string", "format": "date"},
                       "bill_to": obj({"company": SHORT, "address": ADDRESS}),
                       "lines": {"type": "array", "minItems": 1, "maxItems": 5, "items": obj({
                           "description": SHORT, "quantity": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                           "unit_price": {"type": "number", "minimum": 0, "maximum": 100000}})},
                       "currency": {"enum": ["EUR", "USD", "GBP"]},
                       "tax_rate": {"type": "number", "minimum": 0, "maximum": 0.3}}),
    },
    "sentiment": {
        "shape": "enum, bounded number, array 0-3 of short strings",
        "prompt": "Classify the sentiment of this review: 'The battery dies in an hour and support never answered.'",
        "schema": obj({"sentiment": {"enum": ["positive", "neutral", "negative"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                       "aspects": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}}}),
    },
    "event": {
        "shape": "date-time format, anyOf string/null, integer range",
        "prompt": "Create a calendar event: team retrospective on 2025-01-20 at 14:00 UTC, one hour, room 4B.",
        "schema": obj({"title": SHORT, "start": {"type": "string", "format": "date-time"},
                       "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                       "location": {"anyOf": [SHORT, {"type": "null"}]},
                       "recurring": BOOL}),
    },
    "recipe": {
        "shape": "arrays 2-6 and 1-4, nested objects, enum units",
        "prompt": "Give a simple pancake recipe.",
        "schema": obj({"name": SHORT, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                       "ingredients": {"type": "array", "minItems": 2, "maxItems": 6, "items": obj({
                           "item": {"type": "string", "minLength": 1, "maxLength": 24},
                           "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                           "unit": {"enum": ["g", "ml", "piece", "tbsp", "tsp", "cup"]}})},
                       "steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 60}}}),
    },
    "weather": {
        "shape": "ranged numbers (negative), enum, const",
        "prompt": "Report the weather in Oslo: minus 3 degrees, snowing, wind 20 km/h.",
        "schema": obj({"kind": {"const": "weather_report"}, "city": SHORT,
                       "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                       "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog", "storm"]},
                       "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100}}, ["kind", "city", "temperature_c", "condition"]),
    },
    "contact_card": {
        "shape": "phone pattern, array 1-3 of anyOf objects",
        "prompt": "Make a contact card for Dr. Ken Sato, phone +81-3-5555-0101, email ken@sato.jp.",
        "schema": obj({"full_name": SHORT,
                       "channels": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"anyOf": [
                           obj({"type": {"const": "phone"}, "number": {"type": "string", "pattern": "^\\+[0-9]{1,3}(-[0-9]{1,4}){2,4}$"}}),
                           obj({"type": {"const": "email"}, "address": {"type": "string", "format": "email"}})]}},
                       "title": {"anyOf": [{"enum": ["Dr.", "Mr.", "Ms.", "Prof."]}, {"type": "null"}]}}),
    },
    "product": {
        "shape": "open object, optional fields, tags array 0-5",
        "prompt": "Describe a product listing for a blue cotton t-shirt costing 19.90 euros, in sizes S to XL.",
        "schema": obj({"title": SHORT, "price": {"type": "number", "minimum": 0.01, "maximum": 10000},
                       "in_stock": BOOL, "sizes": {"type": "array", "items": {"enum": ["XS", "S", "M", "L", "XL", "XXL"]},
                                                   "minItems": 1, "maxItems": 6},
                       "tags": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 15}}},
                      ["title", "price", "in_stock", "sizes"], closed=False),
    },
    "ticket": {
        "shape": "enum priority, pattern id, anyOf integer/null",
        "prompt": "File a support ticket: the login page returns error 500 since this morning; it blocks all users.",
        "schema": obj({"id": {"type": "string", "pattern": "^TCK-[0-9]{5}$"}, "summary": {"type": "string", "maxLength": 60},
                       "priority": {"enum": ["low", "medium", "high", "critical"]},
                       "component": {"enum": ["auth", "billing", "ui", "api"]},
                       "affected_users": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
                       "reproducible": BOOL}),
    },
    "geo_point": {
        "shape": "latitude / longitude ranges, nested array of points 2-4",
        "prompt": "Give a short walking route in Paris from the Louvre to Notre-Dame as coordinates.",
        "schema": obj({"name": SHORT, "points": {"type": "array", "minItems": 2, "maxItems": 4, "items": obj({
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}})},
            "distance_km": {"type": "number", "exclusiveMinimum": 0, "maximum": 50}}),
    },
    "company_tree": {
        "shape": "3-level nesting with $defs / $ref",
        "prompt": "Describe a small company: its name, its CEO and two departments with a head each.",
        "schema": {"$defs": {"employee": obj({"name": SHORT, "role": SHORT,
                                              "level": {"type": "integer", "minimum": 1, "maximum": 10}})},
                   **obj({"company": SHORT, "ceo": {"$ref": "#/$defs/employee"},
                          "departments": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
                              "name": SHORT, "head": {"$ref": "#/$defs/employee"},
                              "headcount": {"type": "integer", "minimum": 1, "maximum": 500}})}})},
    },
    "flight": {
        "shape": "IATA patterns, date, enum cabin, integer range",
        "prompt": "Book a flight from Paris CDG to New York JFK on 2025-06-02 in economy for 2 passengers.",
        "schema": obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                       "date": {"type": "string", "format": "date"},
                       "cabin": {"enum": ["economy", "premium", "business", "first"]},
                       "passengers": {"type": "integer", "minimum": 1, "maximum": 9}}),
    },
    "medication": {
        "shape": "anyOf of two object shapes, number range",
        "prompt": "Record this prescription: ibuprofen 400 mg tablet, three times a day for 5 days.",
        "schema": obj({"drug": SHORT, "dose": {"anyOf": [
            obj({"unit": {"enum": ["mg", "g"]}, "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 5000}}),
            obj({"unit": {"const": "ml"}, "volume": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}})]},
            "times_per_day": {"type": "integer", "minimum": 1, "maximum": 6},
            "days": {"type": "integer", "minimum": 1, "maximum": 90}}),
    },
    "quiz": {
        "shape": "array 2-4 of questions, each with choices 2-4 and an answer index",
        "prompt": "Write a short geography quiz.",
        "schema": obj({"topic": SHORT, "questions": {"type": "array", "minItems": 2, "maxItems": 4, "items": obj({
            "question": {"type": "string", "maxLength": 80},
            "choices": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "string", "maxLength": 20}},
            "answer_index": {"type": "integer", "minimum": 0, "maximum": 3}})}}),
    },
    "log_entry": {
        "shape": "enum level, uuid format, nullable object",
        "prompt": "Turn this log line into a record: 'ERROR payment-service timeout after 30s calling bank API'.",
        "schema": obj({"level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]}, "service": {"type": "string", "pattern": "^[a-z][a-z-]{1,30}$"},
                       "request_id": {"type": "string", "format": "uuid"}, "message": {"type": "string", "maxLength": 80},
                       "error": {"anyOf": [obj({"code": {"type": "integer", "minimum": 100, "maximum": 599},
                                                "retryable": BOOL}), {"type": "null"}]}}),
    },
    "bank_transfer": {
        "shape": "IBAN-like pattern, amount range with exclusiveMinimum, enum currency",
        "prompt": "Prepare a transfer of 250 euros to Marie Dupont, IBAN FR7630006000011234567890189, reference rent March.",
        "schema": obj({"beneficiary": SHORT, "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"},
                       "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000000},
                       "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]}, "reference": {"type": "string", "maxLength": 35},
                       "instant": BOOL}),
    },
    "survey": {
        "shape": "array 3-5 of integer ratings 1-5, boolean, anyOf string/null",
        "prompt": "Fill in a customer satisfaction survey for a hotel stay that was mostly good but noisy.",
        "schema": obj({"ratings": {"type": "array", "minItems": 3, "maxItems": 5, "items": {"type": "integer", "minimum": 1, "maximum": 5}},
                       "would_recommend": BOOL, "comment": {"anyOf": [{"type": "string", "maxLength": 100}, {"type": "null"}]}}),
    },
    "color_palette": {
        "shape": "hex pattern strings in an array 3-5",
        "prompt": "Suggest a colour palette for an ocean-themed website.",
        "schema": obj({"theme": SHORT, "colors": {"type": "array", "minItems": 3, "maxItems": 5, "items": obj({
            "name": {"type": "string", "maxLength": 20}, "hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"}})}}),
    },
    "shipment": {
        "shape": "two nested addresses, weight range, enum status, nullable date",
        "prompt": "Track a parcel of 2.5 kg sent from Berlin to Lyon, currently in transit.",
        "schema": obj({"tracking": {"type": "string", "pattern": "^[0-9]{10}$"}, "sender": ADDRESS, "recipient": ADDRESS,
                       "weight_kg": {"type": "number", "exclusiveMinimum": 0, "maximum": 30},
                       "status": {"enum": ["created", "in_transit", "delivered", "returned"]},
                       "delivered_on": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]}}),
    },
    "matrix": {
        "shape": "array of arrays (2-3 x 2-3) of ranged integers",
        "prompt": "Give a small matrix of integers.",
        "schema": obj({"rows": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
            "type": "array", "minItems": 2, "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}}),
    },
    "user_profile": {
        "shape": "username pattern, optional nested preferences, enum language",
        "prompt": "Create a user profile for jdoe42, who prefers dark mode and French.",
        "schema": obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                       "display_name": SHORT, "verified": BOOL,
                       "preferences": obj({"theme": {"enum": ["light", "dark", "system"]},
                                           "language": {"enum": ["en", "fr", "de", "ja"]},
                                           "newsletter": BOOL}, ["theme", "language"]),
                       "followers": {"type": "integer", "minimum": 0, "maximum": 10000000}}, ["username", "display_name", "preferences"]),
    },
    "book": {
        "shape": "isbn pattern, year range, array 1-3 of authors, multi-type",
        "prompt": "Catalogue the book 'Dune' by Frank Herbert, published 1965, ISBN 9780441013593.",
        "schema": obj({"title": SHORT, "authors": {"type": "array", "minItems": 1, "maxItems": 3, "items": SHORT},
                       "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
                       "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
                       "edition": {"type": ["integer", "null"], "minimum": 1},
                       "genres": {"type": "array", "maxItems": 3, "items": {"enum": ["fiction", "sci-fi", "fantasy", "history", "science"]}}}),
    },
    "experiment": {
        "shape": "numbers with ranges in nested array 1-4, p-value in [0, 1], enum",
        "prompt": "Summarise an A/B test: variant B raised conversion from 3.1% to 3.6% on 20000 users each, p = 0.02.",
        "schema": obj({"name": SHORT, "variants": {"type": "array", "minItems": 1, "maxItems": 4, "items": obj({
            "label": {"enum": ["A", "B", "C", "D"]}, "users": {"type": "integer", "minimum": 1, "maximum": 100000000},
            "conversion": {"type": "number", "minimum": 0, "maximum": 1}})},
            "p_value": {"type": "number", "minimum": 0, "maximum": 1}, "significant": BOOL}),
    },
}

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": obj({"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Book a restaurant table.",
        "parameters": obj({"restaurant": SHORT, "date": {"type": "string", "format": "date"},
                           "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                           "people": {"type": "integer", "minimum": 1, "maximum": 12}})}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": obj({"amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000000},
                           "from": {"enum": ["EUR", "USD", "GBP", "JPY"]}, "to": {"enum": ["EUR", "USD", "GBP", "JPY"]}})}},
]
TOOL_PROMPTS = [
    "What is the weather like in Madrid right now?",
    "Book a table for 4 at Chez Paul on 2025-05-10 at 19:30.",
    "How much is 150 dollars in euros?",
    "Is it raining in Tokyo? Answer in fahrenheit.",
    "Reserve dinner for two at Sushi Ko tomorrow, 2025-02-14 at 20:00.",
    "Convert 10000 yen to pounds.",
]


def cold_schema(tag: str) -> dict[str, Any]:
    """A product record with a property named after ``tag``: a schema the server has never compiled."""
    return obj({"name": SHORT, "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "category": {"enum": ["book", "food", "tool", "toy"]}, f"x_{tag}": {"type": "integer", "minimum": 0}},
               ["name", "price"])  # fmt: skip
