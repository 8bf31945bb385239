"""JSON schemas for structured-output (constrained decoding) benchmarks and tests.

Each `SchemaCase` is a schema an application would plausibly send as `response_format` (a person
record, an order, a calendar event, a tool call, ...) together with one valid instance of it. The
instance lets a benchmark walk a grammar matcher token by token through realistic output without a
model, and lets tests check that constrained generation accepts what the schema allows.

Together the schemas cover: nested objects, arrays with minItems/maxItems, enums, const, integers
and numbers with minimum/maximum (and exclusiveMinimum), optional (non-required) fields, string
pattern, string format (date, date-time, email, uuid, hostname, ipv4, uri), minLength/maxLength,
booleans, nullable types (["string", "null"]), anyOf, $ref/$defs (one recursive), and
additionalProperties false (and a string-valued map).

Conventions, so that one instance is valid under every engine's default JSON formatting: the keys of
each example appear in the order the schema declares them (engines emit properties in that order),
and every example validates against its schema (the comparison script checks this with jsonschema).
This module is plain data: it imports nothing beyond the standard library.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class SchemaCase(NamedTuple):
    name: str
    schema: dict[str, Any]
    example: Any


_ISO_COUNTRY = ["US", "CA", "GB", "DE", "FR", "ES", "IT", "NL", "JP", "IN", "BR", "AU"]

PERSON = SchemaCase(
    "person",
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 100},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
            "phone": {"type": ["string", "null"]},
            "nickname": {"type": "string", "maxLength": 30},
        },
        "required": ["name", "age", "email", "phone"],
        "additionalProperties": False,
    },
    {"name": "Maria Gonzalez", "age": 34, "email": "maria.gonzalez@example.com", "phone": None},
)

ADDRESS = SchemaCase(
    "address",
    {
        "type": "object",
        "properties": {
            "street": {"type": "string", "minLength": 1},
            "city": {"type": "string", "minLength": 1},
            "postal_code": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
            "country": {"type": "string", "enum": _ISO_COUNTRY},
            "is_primary": {"type": "boolean"},
        },
        "required": ["street", "city", "postal_code", "country"],
        "additionalProperties": False,
    },
    {"street": "1600 Amphitheatre Parkway", "city": "Mountain View", "postal_code": "94043", "country": "US",
     "is_primary": True},
)

ORDER = SchemaCase(
    "order",
    {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "format": "uuid"},
            "customer_email": {"type": "string", "format": "email"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 20,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                        "unit_price": {"type": "number", "minimum": 0},
                    },
                    "required": ["sku", "quantity", "unit_price"],
                    "additionalProperties": False,
                },
            },
            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
            "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
            "notes": {"type": ["string", "null"], "maxLength": 500},
        },
        "required": ["order_id", "customer_email", "items", "currency", "status"],
        "additionalProperties": False,
    },
    {
        "order_id": "3f2b8c9e-1d4a-4e6b-9c7d-2a1f0e5b6c8d",
        "customer_email": "j.smith@shop.example",
        "items": [
            {"sku": "KBD-1042", "quantity": 1, "unit_price": 89.99},
            {"sku": "MSE-0007", "quantity": 2, "unit_price": 24.5},
        ],
        "currency": "USD",
        "status": "paid",
        "notes": "Leave the parcel at the back door.",
    },
)

CALENDAR_EVENT = SchemaCase(
    "calendar_event",
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 120},
            "start": {"type": "string", "format": "date-time"},
            "end": {"type": "string", "format": "date-time"},
            "all_day": {"type": "boolean"},
            "location": {"type": ["string", "null"]},
            "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 10},
            "recurrence": {
                "anyOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "properties": {
                            "frequency": {"type": "string", "enum": ["daily", "weekly", "monthly", "yearly"]},
                            "interval": {"type": "integer", "minimum": 1, "maximum": 52},
                        },
                        "required": ["frequency", "interval"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
        "required": ["title", "start", "end", "all_day", "location", "attendees", "recurrence"],
        "additionalProperties": False,
    },
    {
        "title": "Weekly planning",
        "start": "2025-03-10T09:00:00Z",
        "end": "2025-03-10T09:30:00Z",
        "all_day": False,
        "location": "Room 4B",
        "attendees": ["ana@corp.example", "li.wei@corp.example"],
        "recurrence": {"frequency": "weekly", "interval": 1},
    },
)

PRODUCT_REVIEW = SchemaCase(
    "product_review",
    {
        "type": "object",
        "properties": {
            "product_id": {"type": "string", "pattern": "^B0[0-9A-Z]{8}$"},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "title": {"type": "string", "maxLength": 80},
            "body": {"type": "string", "minLength": 10, "maxLength": 2000},
            "pros": {"type": "array", "items": {"type": "string", "maxLength": 100}, "maxItems": 5},
            "cons": {"type": "array", "items": {"type": "string", "maxLength": 100}, "maxItems": 5},
            "would_recommend": {"type": "boolean"},
        },
        "required": ["product_id", "rating", "body", "would_recommend"],
        "additionalProperties": False,
    },
    {
        "product_id": "B08N5WRWNW",
        "rating": 4,
        "title": "Great sound, short battery life",
        "body": "The headphones sound excellent and are comfortable for hours, but the battery barely lasts a day.",
        "pros": ["sound quality", "comfort"],
        "cons": ["battery life"],
        "would_recommend": True,
    },
)

WEATHER_REPORT = SchemaCase(
    "weather_report",
    {
        "type": "object",
        "properties": {
            "location": {"type": "string"},
            "date": {"type": "string", "format": "date"},
            "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
            "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow", "fog", "storm"]},
            "humidity_percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "wind": {
                "type": "object",
                "properties": {
                    "speed_kmh": {"type": "number", "minimum": 0},
                    "direction": {"type": "string", "enum": ["N", "NE", "E", "SE", "S", "SW", "W", "NW"]},
                },
                "required": ["speed_kmh", "direction"],
            },
        },
        "required": ["location", "date", "temperature_c", "conditions", "humidity_percent", "wind"],
    },
    {"location": "Oslo", "date": "2025-01-17", "temperature_c": -4.5, "conditions": "snow", "humidity_percent": 81,
     "wind": {"speed_kmh": 12.0, "direction": "NW"}},
)

TOOL_CALL = SchemaCase(
    "tool_call",
    {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
)

SENTIMENT = SchemaCase(
    "sentiment",
    {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["positive", "negative", "neutral", "mixed"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "is_sarcastic": {"type": "boolean"},
        },
        "required": ["label", "confidence", "is_sarcastic"],
        "additionalProperties": False,
    },
    {"label": "mixed", "confidence": 0.72, "is_sarcastic": False},
)

ENTITIES = SchemaCase(
    "entities",
    {
        "type": "object",
        "properties": {
            "entities": {
                "type": "array",
                "maxItems": 50,
                "items": {
                    "type": "object",
                    "properties": {
                        "text": {"type": "string", "minLength": 1},
                        "type": {"type": "string", "enum": ["PERSON", "ORG", "LOCATION", "DATE", "MONEY", "PRODUCT"]},
                        "start": {"type": "integer", "minimum": 0},
                        "end": {"type": "integer", "minimum": 0},
                    },
                    "required": ["text", "type", "start", "end"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["entities"],
        "additionalProperties": False,
    },
    {
        "entities": [
            {"text": "Satya Nadella", "type": "PERSON", "start": 0, "end": 13},
            {"text": "Microsoft", "type": "ORG", "start": 28, "end": 37},
            {"text": "Seattle", "type": "LOCATION", "start": 41, "end": 48},
            {"text": "March 3, 2024", "type": "DATE", "start": 52, "end": 65},
        ]
    },
)

INVOICE = SchemaCase(
    "invoice",
    {
        "$defs": {
            "money": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                },
                "required": ["amount", "currency"],
                "additionalProperties": False,
            },
            "party": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "vat_id": {"type": ["string", "null"]},
                    "country": {"type": "string", "enum": _ISO_COUNTRY},
                },
                "required": ["name", "vat_id", "country"],
                "additionalProperties": False,
            },
        },
        "type": "object",
        "properties": {
            "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "issue_date": {"type": "string", "format": "date"},
            "due_date": {"type": "string", "format": "date"},
            "seller": {"$ref": "#/$defs/party"},
            "buyer": {"$ref": "#/$defs/party"},
            "lines": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "description": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"$ref": "#/$defs/money"},
                    },
                    "required": ["description", "quantity", "unit_price"],
                    "additionalProperties": False,
                },
            },
            "total": {"$ref": "#/$defs/money"},
            "paid": {"type": "boolean"},
        },
        "required": ["invoice_number", "issue_date", "due_date", "seller", "buyer", "lines", "total", "paid"],
        "additionalProperties": False,
    },
    {
        "invoice_number": "INV-004217",
        "issue_date": "2025-02-01",
        "due_date": "2025-03-03",
        "seller": {"name": "Acme GmbH", "vat_id": "DE123456789", "country": "DE"},
        "buyer": {"name": "Jane Doe", "vat_id": None, "country": "NL"},
        "lines": [
            {"description": "Consulting, February", "quantity": 12, "unit_price": {"amount": 95.0, "currency": "EUR"}},
            {"description": "Travel expenses", "quantity": 1, "unit_price": {"amount": 230.4, "currency": "EUR"}},
        ],
        "total": {"amount": 1370.4, "currency": "EUR"},
        "paid": False,
    },
)

RECIPE = SchemaCase(
    "recipe",
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 3, "maxLength": 100},
            "servings": {"type": "integer", "minimum": 1, "maximum": 20},
            "prep_minutes": {"type": "integer", "minimum": 0, "maximum": 600},
            "ingredients": {
                "type": "array",
                "minItems": 1,
                "maxItems": 30,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "quantity": {"type": "number", "exclusiveMinimum": 0},
                        "unit": {
                            "type": ["string", "null"],
                            "enum": ["g", "kg", "ml", "l", "tsp", "tbsp", "cup", None],
                        },
                    },
                    "required": ["name", "quantity", "unit"],
                    "additionalProperties": False,
                },
            },
            "steps": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 5}},
            "vegetarian": {"type": "boolean"},
        },
        "required": ["title", "servings", "ingredients", "steps", "vegetarian"],
        "additionalProperties": False,
    },
    {
        "title": "Pancakes",
        "servings": 4,
        "prep_minutes": 20,
        "ingredients": [
            {"name": "flour", "quantity": 200, "unit": "g"},
            {"name": "milk", "quantity": 300, "unit": "ml"},
            {"name": "eggs", "quantity": 2, "unit": None},
        ],
        "steps": ["Whisk the flour, milk and eggs.", "Rest the batter for 10 minutes.", "Fry in a hot pan."],
        "vegetarian": True,
    },
)

USER_SETTINGS = SchemaCase(
    "user_settings",
    {
        "type": "object",
        "properties": {
            "theme": {"type": "string", "enum": ["light", "dark", "system"]},
            "language": {"type": "string", "pattern": "^[a-z]{2}(-[A-Z]{2})?$"},
            "timezone": {"type": "string", "minLength": 1, "maxLength": 64},
            "notifications": {
                "type": "object",
                "properties": {
                    "email": {"type": "boolean"},
                    "push": {"type": "boolean"},
                    "sms": {"type": "boolean"},
                },
                "required": ["email", "push", "sms"],
                "additionalProperties": False,
            },
            "beta_features": {
                "type": "array",
                "items": {"type": "string", "enum": ["new_editor", "ai_search", "dark_sidebar", "offline_mode"]},
                "maxItems": 4,
            },
        },
        "required": ["theme", "language", "timezone", "notifications"],
        "additionalProperties": False,
    },
    {"theme": "dark", "language": "pt-BR", "timezone": "America/Sao_Paulo",
     "notifications": {"email": True, "push": False, "sms": False}, "beta_features": ["ai_search"]},
)

LOG_ENTRY = SchemaCase(
    "log_entry",
    {
        "type": "object",
        "properties": {
            "timestamp": {"type": "string", "format": "date-time"},
            "level": {"type": "string", "enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
            "service": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,30}$"},
            "message": {"type": "string", "maxLength": 1000},
            "trace_id": {"type": ["string", "null"], "pattern": "^[0-9a-f]{32}$"},
            "attributes": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "required": ["timestamp", "level", "service", "message", "trace_id"],
        "additionalProperties": False,
    },
    {
        "timestamp": "2025-04-02T14:07:31.204Z",
        "level": "ERROR",
        "service": "payment-api",
        "message": "Card authorization timed out after 3 retries",
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "attributes": {"region": "eu-west-1", "http.status": "504"},
    },
)

API_ERROR = SchemaCase(
    "api_error",
    {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "status": {"type": "integer", "minimum": 400, "maximum": 599},
                    "code": {"type": "string", "enum": ["invalid_request", "not_found", "rate_limited", "internal"]},
                    "message": {"type": "string", "minLength": 1, "maxLength": 300},
                    "retryable": {"type": "boolean"},
                    "details": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"field": {"type": "string"}, "issue": {"type": "string"}},
                            "required": ["field", "issue"],
                            "additionalProperties": False,
                        },
                        "maxItems": 10,
                    },
                },
                "required": ["status", "code", "message", "retryable"],
                "additionalProperties": False,
            }
        },
        "required": ["error"],
        "additionalProperties": False,
    },
    {"error": {"status": 422, "code": "invalid_request", "message": "The request body failed validation.",
               "retryable": False, "details": [{"field": "email", "issue": "must be a valid email address"}]}},
)

SEARCH_QUERY = SchemaCase(
    "search_query",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 200},
            "filters": {
                "type": "object",
                "properties": {
                    "category": {"type": ["string", "null"], "enum": ["books", "electronics", "home", "toys", None]},
                    "price_min": {"type": ["number", "null"], "minimum": 0},
                    "price_max": {"type": ["number", "null"], "minimum": 0},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["category", "price_min", "price_max", "in_stock"],
                "additionalProperties": False,
            },
            "sort": {"type": "string", "enum": ["relevance", "price_asc", "price_desc", "newest"]},
            "page": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        "required": ["query", "filters", "sort", "page"],
        "additionalProperties": False,
    },
    {"query": "noise cancelling headphones", "filters": {"category": "electronics", "price_min": None,
                                                         "price_max": 150, "in_stock": True},
     "sort": "price_asc", "page": 1},
)

CONTACT_METHOD = SchemaCase(
    "contact_method",
    {
        "type": "object",
        "properties": {
            "contact_name": {"type": "string"},
            "preferred": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "email"}, "address": {"type": "string", "format": "email"}},
                        "required": ["kind", "address"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "phone"},
                            "number": {"type": "string", "pattern": "^\\+[1-9][0-9]{6,14}$"},
                            "sms_ok": {"type": "boolean"},
                        },
                        "required": ["kind", "number"],
                        "additionalProperties": False,
                    },
                ]
            },
        },
        "required": ["contact_name", "preferred"],
        "additionalProperties": False,
    },
    {"contact_name": "Tomás Ruiz", "preferred": {"kind": "phone", "number": "+34612345678", "sms_ok": True}},
)

BANK_TRANSACTION = SchemaCase(
    "bank_transaction",
    {
        "type": "object",
        "properties": {
            "transaction_id": {"type": "string", "format": "uuid"},
            "booked_at": {"type": "string", "format": "date-time"},
            "amount": {"type": "number", "exclusiveMinimum": 0},
            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "CHF"]},
            "direction": {"type": "string", "enum": ["debit", "credit"]},
            "counterparty": {"type": "string", "maxLength": 140},
            "category": {"type": ["string", "null"], "enum": ["groceries", "rent", "salary", "travel", "other", None]},
        },
        "required": ["transaction_id", "booked_at", "amount", "currency", "direction", "counterparty", "category"],
        "additionalProperties": False,
    },
    {"transaction_id": "a8098c1a-f86e-11da-bd1a-00112444be1e", "booked_at": "2025-05-30T08:12:00+02:00",
     "amount": 54.2, "currency": "EUR", "direction": "debit", "counterparty": "Albert Heijn 1043",
     "category": "groceries"},
)

MEETING_NOTES = SchemaCase(
    "meeting_notes",
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "date": {"type": "string", "format": "date"},
            "attendees": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            "decisions": {"type": "array", "items": {"type": "string"}},
            "action_items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "owner": {"type": "string"},
                        "task": {"type": "string", "minLength": 3},
                        "due": {"type": ["string", "null"], "format": "date"},
                    },
                    "required": ["owner", "task", "due"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["title", "date", "attendees", "decisions", "action_items"],
        "additionalProperties": False,
    },
    {
        "title": "Q3 roadmap review",
        "date": "2025-06-12",
        "attendees": ["Priya", "Marcus", "Elena"],
        "decisions": ["Ship the export feature before the mobile app.", "Drop IE11 support."],
        "action_items": [
            {"owner": "Marcus", "task": "Write the export spec", "due": "2025-06-20"},
            {"owner": "Elena", "task": "Announce the browser support change", "due": None},
        ],
    },
)

JOB_POSTING = SchemaCase(
    "job_posting",
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 2, "maxLength": 100},
            "company": {"type": "string"},
            "location": {
                "type": "object",
                "properties": {
                    "city": {"type": ["string", "null"]},
                    "country": {"type": "string", "enum": _ISO_COUNTRY},
                    "remote": {"type": "boolean"},
                },
                "required": ["city", "country", "remote"],
                "additionalProperties": False,
            },
            "employment_type": {"type": "string", "enum": ["full_time", "part_time", "contract", "internship"]},
            "salary": {
                "anyOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "properties": {
                            "min": {"type": "integer", "minimum": 0},
                            "max": {"type": "integer", "minimum": 0},
                            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                            "period": {"type": "string", "enum": ["hour", "month", "year"]},
                        },
                        "required": ["min", "max", "currency", "period"],
                        "additionalProperties": False,
                    },
                ]
            },
            "skills": {"type": "array", "minItems": 1, "maxItems": 15, "items": {"type": "string"}},
        },
        "required": ["title", "company", "location", "employment_type", "salary", "skills"],
        "additionalProperties": False,
    },
    {
        "title": "Senior Backend Engineer",
        "company": "Northwind Labs",
        "location": {"city": "Berlin", "country": "DE", "remote": True},
        "employment_type": "full_time",
        "salary": {"min": 75000, "max": 95000, "currency": "EUR", "period": "year"},
        "skills": ["Python", "PostgreSQL", "Kubernetes"],
    },
)

FLIGHT_BOOKING = SchemaCase(
    "flight_booking",
    {
        "$defs": {
            "passenger": {
                "type": "object",
                "properties": {
                    "first_name": {"type": "string", "minLength": 1, "maxLength": 50},
                    "last_name": {"type": "string", "minLength": 1, "maxLength": 50},
                    "date_of_birth": {"type": "string", "format": "date"},
                },
                "required": ["first_name", "last_name", "date_of_birth"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "booking_reference": {"type": "string", "pattern": "^[A-Z0-9]{6}$"},
            "passengers": {"type": "array", "minItems": 1, "maxItems": 9, "items": {"$ref": "#/$defs/passenger"}},
            "segments": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
                        "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "departure": {"type": "string", "format": "date-time"},
                        "cabin": {"type": "string", "enum": ["economy", "premium_economy", "business", "first"]},
                        "seat": {"type": ["string", "null"], "pattern": "^[0-9]{1,2}[A-K]$"},
                    },
                    "required": ["flight_number", "from", "to", "departure", "cabin", "seat"],
                    "additionalProperties": False,
                },
            },
            "total_price": {"type": "number", "minimum": 0},
            "confirmed": {"const": True},
        },
        "required": ["booking_reference", "passengers", "segments", "total_price", "confirmed"],
        "additionalProperties": False,
    },
    {
        "booking_reference": "QX7P2M",
        "passengers": [{"first_name": "Aiko", "last_name": "Tanaka", "date_of_birth": "1990-07-21"}],
        "segments": [
            {"flight_number": "LH400", "from": "FRA", "to": "JFK", "departure": "2025-09-14T10:25:00Z",
             "cabin": "economy", "seat": "32C"},
            {"flight_number": "LH401", "from": "JFK", "to": "FRA", "departure": "2025-09-28T17:40:00Z",
             "cabin": "economy", "seat": None},
        ],
        "total_price": 812.37,
        "confirmed": True,
    },
)

COMMENT_THREAD = SchemaCase(
    "comment_thread",
    {
        "$defs": {
            "comment": {
                "type": "object",
                "properties": {
                    "author": {"type": "string", "minLength": 1, "maxLength": 40},
                    "text": {"type": "string", "minLength": 1},
                    "likes": {"type": "integer", "minimum": 0},
                    "replies": {"type": "array", "items": {"$ref": "#/$defs/comment"}},
                },
                "required": ["author", "text", "likes", "replies"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/comment",
    },
    {
        "author": "kim",
        "text": "Does this work on ARM?",
        "likes": 3,
        "replies": [
            {"author": "dev_sam", "text": "Yes, since version 2.1.", "likes": 5, "replies": []},
            {"author": "kim", "text": "Thanks!", "likes": 0, "replies": []},
        ],
    },
)

SERVICE_HEALTH = SchemaCase(
    "service_health",
    {
        "type": "object",
        "properties": {
            "host": {"type": "string", "format": "hostname"},
            "ip": {"type": "string", "format": "ipv4"},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "status_page": {"type": "string", "format": "uri"},
            "healthy": {"type": "boolean"},
            "latency_ms": {"type": "number", "minimum": 0, "maximum": 60000},
            "checked_on": {"type": "string", "format": "date"},
        },
        "required": ["host", "ip", "port", "status_page", "healthy", "latency_ms", "checked_on"],
        "additionalProperties": False,
    },
    {"host": "api.internal.example.com", "ip": "10.12.0.7", "port": 8443,
     "status_page": "https://status.example.com/api", "healthy": True, "latency_ms": 41.7,
     "checked_on": "2025-08-01"},
)

SCHEMAS: list[SchemaCase] = [
    PERSON,
    ADDRESS,
    ORDER,
    CALENDAR_EVENT,
    PRODUCT_REVIEW,
    WEATHER_REPORT,
    TOOL_CALL,
    SENTIMENT,
    ENTITIES,
    INVOICE,
    RECIPE,
    USER_SETTINGS,
    LOG_ENTRY,
    API_ERROR,
    SEARCH_QUERY,
    CONTACT_METHOD,
    BANK_TRANSACTION,
    MEETING_NOTES,
    JOB_POSTING,
    FLIGHT_BOOKING,
    COMMENT_THREAD,
    SERVICE_HEALTH,
]
